#pragma once
// Errors thrown by hicache.
//
// Bad input from the caller raises std::invalid_argument (a wrong size, a malformed layout) or
// std::out_of_range (a block id or slot outside its pool); nanobind maps them to ValueError and
// IndexError. hicache::Error is for failures of the cache itself (a copy that could not be
// launched, a host pool that could not be allocated): the policy catches those, counts them and
// degrades to a miss, so a cache failure never fails a request.

#include <stdexcept>
#include <string>

namespace hicache {

/// A failure of the cache machinery (copier, host pool), as opposed to bad caller input.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Raised for a request id that the cache does not know (never seen, or already forgotten).
class UnknownRequest : public std::out_of_range {
 public:
  using std::out_of_range::out_of_range;
};

}  // namespace hicache
