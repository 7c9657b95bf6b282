from dormouse.fnv import fnv1a_64


def test_fnv1a_64_reference_vectors():
    assert fnv1a_64("") == 0xCBF29CE484222325
    assert fnv1a_64("a") == 0xAF63DC4C8601EC8C
    assert fnv1a_64("foobar") == 0x85944171F73967E8


def test_is_not_plain_fnv1():
    assert fnv1a_64("a") != 0xAF63BD4C8601B7BE  # FNV-1 (multiply before xor) of "a"


def test_str_is_hashed_as_utf8():
    assert fnv1a_64("é") == fnv1a_64("é".encode("utf-8"))
