"""The chat template: the one definition of how conversation turns become bytes.

A turn is its opener byte (USER 0x01 or ASSISTANT 0x02), the text as UTF-8, then END 0x03:

    encode_turns([("user", "hi"), ("assistant", "yo")]) == b"\\x01hi\\x03\\x02yo\\x03"

Generation starts after `prompt_bytes(user_text)` (a user turn plus the ASSISTANT opener) and the
reply is everything before the first END (`parse_assistant`).

Text containing 0x01/0x02/0x03 is rejected, not escaped: those bytes then mean turn boundaries and
nothing else, so no text can forge a turn, and no real text needs them.
"""

from __future__ import annotations

import re

USER, ASSISTANT, END = 0x01, 0x02, 0x03
ROLE_OPENERS = {"user": USER, "assistant": ASSISTANT}
_BYTE_NAMES = {USER: "USER", ASSISTANT: "ASSISTANT", END: "END"}
RESERVED_PATTERN = re.compile("[\x01\x02\x03]")  # also used by the filter: corpus text never holds them


class ChatTemplateError(ValueError):
    """A turn the template cannot encode: an unknown role, or text holding a reserved byte."""


def _check_text(role: str, text: str) -> None:
    found = RESERVED_PATTERN.search(text)
    if found:
        byte = ord(found.group())
        raise ChatTemplateError(
            f"{role} text contains byte 0x{byte:02x} ({_BYTE_NAMES[byte]}) at index {found.start()}; "
            "the chat template reserves 0x01, 0x02 and 0x03 for turn boundaries")


def encode_turns_with_mask(turns: list[tuple[str, str]]) -> tuple[bytes, list[bool]]:
    """The conversation's bytes and, per byte, whether it is an assistant byte the loss counts.

    The mask covers each assistant turn's text and its closing END (the model must learn to stop),
    not the ASSISTANT opener: the prompt always supplies that byte.
    """
    out, mask = bytearray(), []
    for role, text in turns:
        if role not in ROLE_OPENERS:
            raise ChatTemplateError(f"unknown role {role!r}; expected one of {sorted(ROLE_OPENERS)}")
        _check_text(role, text)
        body = text.encode("utf-8") + bytes([END])
        out.append(ROLE_OPENERS[role])
        mask.append(False)
        out += body
        mask += [role == "assistant"] * len(body)
    return bytes(out), mask


def encode_turns(turns: list[tuple[str, str]]) -> bytes:
    return encode_turns_with_mask(turns)[0]


def prompt_bytes(user_text: str) -> bytes:
    """A user turn followed by the ASSISTANT opener: generation continues from here."""
    return encode_turns([("user", user_text)]) + bytes([ASSISTANT])


def sft_example(user_text: str, assistant_text: str) -> tuple[bytes, list[bool]]:
    """One exchange for supervised fine-tuning; mask[i] is True exactly on the assistant text and its END."""
    return encode_turns_with_mask([("user", user_text), ("assistant", assistant_text)])


def parse_assistant(generated: bytes) -> str | None:
    """The reply in bytes generated after `prompt_bytes`: the text before the first END.

    None when the reply is malformed: no END (unterminated), a USER or ASSISTANT byte before it
    (the model opened a turn instead of closing its own), or invalid UTF-8.
    """
    end = generated.find(END)
    if end < 0:
        return None
    body = generated[:end]
    if USER in body or ASSISTANT in body:
        return None
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        return None
