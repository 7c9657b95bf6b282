import pytest

from dormouse.data.chat import (
    ASSISTANT,
    END,
    USER,
    ChatTemplateError,
    encode_turns,
    encode_turns_with_mask,
    parse_assistant,
    prompt_bytes,
    sft_example,
)


def test_template_bytes_are_fixed():
    assert (USER, ASSISTANT, END) == (0x01, 0x02, 0x03)


def test_encode_turns_byte_layout():
    assert encode_turns([("user", "hi"), ("assistant", "yo"), ("user", "é")]) == (
        b"\x01hi\x03\x02yo\x03\x01\xc3\xa9\x03")
    assert encode_turns([]) == b""
    assert encode_turns([("assistant", "")]) == b"\x02\x03"


def test_prompt_bytes_ends_with_assistant_opener():
    assert prompt_bytes("Compute 1 + 2") == b"\x01Compute 1 + 2\x03\x02"


def test_sft_mask_covers_exactly_assistant_text_and_end():
    data, mask = sft_example("ab", "xyz")
    assert data == b"\x01ab\x03\x02xyz\x03"
    assert mask == [False, False, False, False, False, True, True, True, True]
    assert data.startswith(prompt_bytes("ab"))  # generation sees the same prefix training did
    assert bytes(b for b, m in zip(data, mask) if m) == b"xyz\x03"


def test_mask_counts_utf8_bytes_not_characters():
    data, mask = sft_example("q", "é")  # one character, two bytes
    assert bytes(b for b, m in zip(data, mask) if m) == b"\xc3\xa9\x03"
    assert len(mask) == len(data)


def test_multi_turn_mask_covers_every_assistant_turn():
    data, mask = encode_turns_with_mask([("user", "a"), ("assistant", "b"), ("user", "c"), ("assistant", "d")])
    assert data == b"\x01a\x03\x02b\x03\x01c\x03\x02d\x03"
    assert bytes(b for b, m in zip(data, mask) if m) == b"b\x03d\x03"


@pytest.mark.parametrize("byte,name", [(0x01, "USER"), (0x02, "ASSISTANT"), (0x03, "END")])
def test_reserved_bytes_in_text_are_rejected_naming_byte_and_position(byte, name):
    text = "abc" + chr(byte) + "d"
    with pytest.raises(ChatTemplateError, match=rf"user text contains byte 0x0{byte} \({name}\) at index 3"):
        prompt_bytes(text)
    with pytest.raises(ChatTemplateError, match=rf"assistant text contains byte 0x0{byte} \({name}\) at index 3"):
        sft_example("fine", text)


def test_unknown_role_is_rejected():
    with pytest.raises(ChatTemplateError, match="unknown role 'system'"):
        encode_turns([("system", "x")])


def test_parse_assistant():
    assert parse_assistant(b"579\x03") == "579"
    assert parse_assistant(b"579\x03\x01junk after the turn") == "579"
    assert parse_assistant(b"\x03") == ""
    assert parse_assistant("é".encode() + b"\x03") == "é"


def test_parse_assistant_malformed_is_none():
    assert parse_assistant(b"579") is None  # unterminated
    assert parse_assistant(b"") is None
    assert parse_assistant(b"57\x019\x03") is None  # opened a user turn before closing its own
    assert parse_assistant(b"57\x029\x03") is None
    assert parse_assistant(b"\xc3\x03") is None  # truncated UTF-8


def test_round_trip_of_an_encoded_reply():
    data, _ = sft_example("q", "the answer")
    assert parse_assistant(data[len(prompt_bytes("q")):]) == "the answer"
