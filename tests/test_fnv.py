from dormouse.data.fnv import fnv1a_64


def test_fnv1a_64_reference_vectors():
    assert fnv1a_64("") == 0xCBF29CE484222325
    assert fnv1a_64("a") == 0xAF63DC4C8601EC8C
    assert fnv1a_64("foobar") == 0x85944171F73967E8


def test_is_not_plain_fnv1():
    assert fnv1a_64("a") != 0xAF63BD4C8601B7BE  # FNV-1 (multiply before xor) of "a"


def test_str_is_hashed_as_utf8():
    assert fnv1a_64("é") == fnv1a_64("é".encode("utf-8"))


def test_mix64_is_murmur3s_finaliser():
    """Checked against the same finaliser in numpy's wrapping uint64 arithmetic (independent of the int code)."""
    import numpy as np

    from dormouse.data.fnv import mix64

    xs = np.array([0, 1, 2, 0xFFFFFFFFFFFFFFFF, 0xCBF29CE484222325, 1 << 63], dtype=np.uint64)
    h = xs ^ (xs >> np.uint64(33))
    h = h * np.uint64(0xFF51AFD7ED558CCD)
    h ^= h >> np.uint64(33)
    h = h * np.uint64(0xC4CEB9FE1A85EC53)
    h ^= h >> np.uint64(33)
    assert [mix64(int(x)) for x in xs] == [int(v) for v in h]
    assert mix64(0) == 0 and len({mix64(i) for i in range(10_000)}) == 10_000


def test_the_smallest_doc_hashes_are_a_sample_not_runs_of_neighbouring_ids():
    """Sequential ids in four domains: the 5% smallest doc_hash values hold each domain's share and no long run of
    consecutive ids (raw FNV-1a held 750 to 1 350 of 4 000 and runs of 20+ neighbours)."""
    from dormouse.data.fnv import doc_hash

    ids = [f"{d}-{i:06d}" for d in ("alpha", "beta", "gamma", "delta") for i in range(20_000)]
    low = sorted(range(len(ids)), key=lambda i: doc_hash(ids[i]))[:4000]
    per_domain = {d: sum(ids[i].startswith(d) for i in low) for d in ("alpha", "beta", "gamma", "delta")}
    assert all(abs(n - 1000) < 5 * 29 for n in per_domain.values()), per_domain  # binomial sd ~27
    nums = sorted(int(ids[i].split("-")[1]) for i in low if ids[i].startswith("alpha"))
    longest = run = 1
    for a, b in zip(nums, nums[1:]):
        run = run + 1 if b == a + 1 else 1
        longest = max(longest, run)
    assert longest <= 4, longest
