#pragma once
// Creating a region sweeps every region on the machine whose creator died, as an engine's does
// (shared_region.hpp). A test that kills a region's creator and then looks at what was left can
// lose that region to a test creating one beside it: ctest runs two at once, and another
// checkout's run may share the machine. Tests that create regions hold this lock, a flock on one
// file for the whole machine, so none runs beside another; the Python tests take the same one
// (tests/conftest.py, shared_region_lock). A forked child inherits it and drops it as it dies.
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>

class SharedRegionTestLock {
 public:
  static constexpr const char* kPath = "/tmp/hicache-tests-shared-regions.lock";
  // Read-only: another user's tests can lock the file too (it is 0644 once made).
  SharedRegionTestLock() : fd_(::open(kPath, O_RDONLY | O_CREAT | O_CLOEXEC, 0644)) {
    while (fd_ >= 0 && ::flock(fd_, LOCK_EX) != 0 && errno == EINTR) {
    }
  }
  ~SharedRegionTestLock() {
    if (fd_ >= 0) ::close(fd_);
  }
  SharedRegionTestLock(const SharedRegionTestLock&) = delete;
  SharedRegionTestLock& operator=(const SharedRegionTestLock&) = delete;
  bool held() const { return fd_ >= 0; }

 private:
  int fd_;
};
