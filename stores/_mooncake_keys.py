"""Where a Mooncake store keeps what, under its namespace (``/`` separated)::

    {namespace}/{sample_id}/g{generation}/{name}   raw bytes of one non-empty tensor
    {namespace}/{sample_id}/g{generation}/@        the generation's record
    {namespace}/{sample_id}/@head                  the current generation's record, again
    {namespace}/@generations/{base}                claim of generations base .. base + 2**20 - 1

``@`` is in neither sample ids nor feature names, so no key of one sample can
be a key of another, nor of the namespace's own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from dataflow import InvalidSampleIdError
from dataflow.model import validate_sample_id

_GENERATION_KEY_RE = re.compile(r"(.+)/g(0|[1-9][0-9]{0,19})/(@|[A-Za-z0-9_.-]{1,128})")
_HEAD_KEY_RE = re.compile(r"(.+)/@head")
# What a regex (ECMAScript, Mooncake's remove_by_regex) must escape of a key's characters.
_REGEX_SPECIAL = re.compile(r"[.^$*+?()\[\]{}|\\]")


@dataclass(frozen=True)
class KeyLayout:
    """The keys of one namespace."""

    namespace: str

    @property
    def prefix(self) -> str:
        """What every key of the namespace starts with."""
        return f"{self.namespace}/"

    def head(self, sample_id: str) -> str:
        return f"{self.namespace}/{sample_id}/@head"

    def generation(self, sample_id: str, generation: int, names: list[str]) -> list[str]:
        """The generation's record first, then one key per named tensor."""
        prefix = f"{self.namespace}/{sample_id}/g{generation}"
        return [f"{prefix}/@", *(f"{prefix}/{name}" for name in names)]

    def record(self, sample_id: str, generation: int) -> str:
        return self.generation(sample_id, generation, [])[0]

    def tensors_pattern(self, sample_id: str, generation: int) -> str:
        """The regex (for ``remove_by_regex``) of every tensor key of a generation."""
        prefix = self.record(sample_id, generation).removesuffix("@")
        escaped = _REGEX_SPECIAL.sub(lambda m: "\\" + m.group(), prefix)
        return f"^{escaped}[^/@]+$"

    def parse(self, key: str) -> tuple[str, str, int]:
        """What a key of the namespace is: ``("record" | "tensor" | "head", sample_id,
        generation)`` (generation -1 for a head); ``("", "", -1)`` for anything else (a
        claim of generations, or a key that no dataflow writes)."""
        start = len(self.prefix)
        match = _GENERATION_KEY_RE.fullmatch(key, start)
        head = None if match else _HEAD_KEY_RE.fullmatch(key, start)
        found = match or head
        if found is None:
            return "", "", -1
        try:
            sample_id = validate_sample_id(found.group(1))
        except InvalidSampleIdError:
            return "", "", -1
        if head is not None:
            return "head", sample_id, -1
        kind = "record" if match.group(3) == "@" else "tensor"
        return kind, sample_id, int(match.group(2))
