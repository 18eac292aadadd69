import hashlib

import numpy as np
import pytest

import hicache
from hicache.hash_chain import reference_chain_keys


def hashlib_chain(tokens: np.ndarray, block_tokens: int, salt: bytes) -> list[bytes]:
    keys, prev = [], salt
    for i in range(len(tokens) // block_tokens):
        chunk = tokens[i * block_tokens : (i + 1) * block_tokens].astype("<i4").tobytes()
        prev = hashlib.blake2b(chunk + prev, digest_size=16).digest()
        keys.append(prev)
    return keys


@pytest.mark.parametrize("block_tokens", [1, 16, 128, 257])
@pytest.mark.parametrize("salt", [b"", b"tenant-7", bytes(range(200))])
def test_chain_keys_are_bit_identical_to_hashlib(block_tokens: int, salt: bytes) -> None:
    rng = np.random.default_rng(block_tokens)
    # 3000 pages of 128 tokens: hashed on several threads, in two runs
    for n in [0, block_tokens - 1, block_tokens, 5 * block_tokens + 3, 3000 * block_tokens + 1]:
        tokens = rng.integers(-(2**31), 2**31 - 1, size=n, dtype=np.int64)
        assert hicache.chain_keys(tokens, block_tokens, salt) == hashlib_chain(tokens, block_tokens, salt)


def test_chain_accepts_lists_and_torch_tensors() -> None:
    torch = pytest.importorskip("torch")
    tokens = list(range(300))
    expect = hashlib_chain(np.array(tokens), 128, b"")
    assert hicache.chain_keys(tokens) == expect
    assert hicache.chain_keys(torch.arange(300)) == expect
    assert hicache.chain_keys(np.arange(300, dtype=np.int16)) == expect


def test_truncated_keys_match_the_python_model() -> None:
    tokens = np.arange(1000)
    for bits in [1, 3, 8, 12, 64, 127]:
        assert hicache.chain_keys(tokens, 16, b"s", key_bits=bits) == reference_chain_keys(
            tokens, 16, b"s", bits
        )


def test_tokens_outside_int32_are_rejected() -> None:
    with pytest.raises(ValueError, match="int32"):
        hicache.chain_keys(np.array([2**31]), 1)
