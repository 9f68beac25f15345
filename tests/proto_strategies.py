"""Hypothesis strategies for any protobuf message, derived from its descriptor.

A new field or message is fuzzed without anyone writing a strategy for it: every scalar type gets its
extremes (the ends of its range, NaN and infinities, empty, very long, NUL and non-ASCII text), enums
get unknown numbers too, nested and repeated fields and maps are filled, oneofs pick one member or
none. `hints` steer fields by name (full name first, e.g. "phalanx.v1.JobSpec.command", then the
bare name) towards values the server knows, so calls reach past "not found"; a hint gives the whole
value of the field (a list for a repeated field, a dict for a map). `mutations` of a valid seed
change a field or three and keep the rest, and `undecodable` makes bytes that are rarely a message.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

Hints = Mapping[str, st.SearchStrategy]

_F = FieldDescriptor
_INT_RANGES = {
    _F.TYPE_INT32: (-(2**31), 2**31 - 1), _F.TYPE_SINT32: (-(2**31), 2**31 - 1),
    _F.TYPE_SFIXED32: (-(2**31), 2**31 - 1), _F.TYPE_UINT32: (0, 2**32 - 1), _F.TYPE_FIXED32: (0, 2**32 - 1),
    _F.TYPE_INT64: (-(2**63), 2**63 - 1), _F.TYPE_SINT64: (-(2**63), 2**63 - 1),
    _F.TYPE_SFIXED64: (-(2**63), 2**63 - 1), _F.TYPE_UINT64: (0, 2**64 - 1), _F.TYPE_FIXED64: (0, 2**64 - 1),
}
_ODD_TEXT = ["", " ", "\x00", "a\x00b", "\n", "line\r\nbreak", "-", ".", "..", "/", "../../etc/passwd", "%s%n",
             "é", "日本語", "🙂", "\u202e", "\ufeff"]
# long values are made on demand: as literals they would bloat every strategy's repr
_LONG_TEXT = st.sampled_from([("x", 300), ("ab", 5000), ("é", 3000)]).map(lambda t: t[0] * t[1])
_LONG_BYTES = st.sampled_from([(b"\x00", 1000), (b"\xff", 70_000)]).map(lambda t: t[0] * t[1])
_ODD_FLOATS = [0.0, -0.0, 1.0, -1.0, float("nan"), float("inf"), float("-inf"), 1e308, -1e308, 5e-324, 2.0**63, 2.0**64]
_UNSET = object()


def _ints(low: int, high: int) -> st.SearchStrategy[int]:
    edges = sorted({v for v in (low, low + 1, -1, 0, 1, 2, high - 1, high, 2**31 - 1, 2**31, 2**32 - 1,
                                2**63 - 1, 2**63) if low <= v <= high})
    return st.one_of(st.sampled_from(edges), st.integers(low, high), st.integers(max(low, -100), min(high, 100)))


def text() -> st.SearchStrategy[str]:
    return st.one_of(st.text(max_size=12), st.sampled_from(_ODD_TEXT), st.text(min_size=40, max_size=200), _LONG_TEXT)


def scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    t = field.type
    if t in _INT_RANGES:
        return _ints(*_INT_RANGES[t])
    if t == _F.TYPE_DOUBLE:
        return st.one_of(st.sampled_from(_ODD_FLOATS), st.floats())
    if t == _F.TYPE_FLOAT:
        return st.one_of(st.sampled_from([0.0, float("nan"), float("inf"), float("-inf")]), st.floats(width=32))
    if t == _F.TYPE_BOOL:
        return st.booleans()
    if t == _F.TYPE_STRING:
        return text()
    if t == _F.TYPE_BYTES:
        return st.one_of(st.binary(max_size=32), _LONG_BYTES)
    if t == _F.TYPE_ENUM:
        known = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(known), _ints(-(2**31), 2**31 - 1))  # proto3 enums are open
    raise TypeError(f"{field.full_name}: no strategy for field type {t}")


def _synthetic(field: FieldDescriptor) -> bool:
    """A proto3 `optional` field: its own one-member oneof."""
    oneof = field.containing_oneof
    return oneof is not None and len(oneof.fields) == 1 and oneof.name == "_" + field.name


def _set(msg: Message, field: FieldDescriptor, value: Any) -> None:
    if value is _UNSET:
        return
    name = field.name
    if _is_map(field):
        target = getattr(msg, name)
        for k, v in value.items():
            if isinstance(v, Message):
                target[k].CopyFrom(v)
            else:
                target[k] = v
    elif field.is_repeated:
        getattr(msg, name).extend(value)
    elif field.message_type is not None:
        getattr(msg, name).CopyFrom(value)
    else:
        setattr(msg, name, value)


def _is_map(field: FieldDescriptor) -> bool:
    return field.message_type is not None and field.message_type.GetOptions().map_entry


def message_class(descriptor: Descriptor) -> type[Message]:
    return message_factory.GetMessageClass(descriptor)


class ProtoStrategies:
    """Strategies for messages and their fields, made once per type and depth (making them is not cheap)."""

    def __init__(self, hints: Hints | None = None, depth: int = 3) -> None:
        self.hints = dict(hints or {})
        self.depth = depth
        self._messages: dict[tuple[str, int], st.SearchStrategy[Message]] = {}
        self._values: dict[tuple[str, int], st.SearchStrategy[Any]] = {}
        self._mutations: dict[int, st.SearchStrategy[Message]] = {}

    def message(self, descriptor: Descriptor, depth: int | None = None) -> st.SearchStrategy[Message]:
        """Messages of `descriptor`'s type with every field drawn from its own strategy."""
        depth = self.depth if depth is None else depth
        key = (descriptor.full_name, depth)
        if key not in self._messages:
            self._messages[key] = st.deferred(lambda: self._make_message(descriptor, depth))
        return self._messages[key]

    def _make_message(self, descriptor: Descriptor, depth: int) -> st.SearchStrategy[Message]:
        cls = message_class(descriptor)
        parts: dict[str, st.SearchStrategy] = {}
        for oneof in descriptor.oneofs:
            if len(oneof.fields) == 1 and _synthetic(oneof.fields[0]):
                continue  # proto3 `optional`: handled as its field
            members = [st.tuples(st.just(f), self.value(f, depth)) for f in oneof.fields]
            parts[f"oneof:{oneof.name}"] = st.one_of(st.just(_UNSET), *members)
        for field in descriptor.fields:
            if field.containing_oneof is None or _synthetic(field):
                parts[field.name] = self.value(field, depth)

        def build(values: dict[str, Any]) -> Message:
            msg = cls()
            for key, value in values.items():
                if key.startswith("oneof:"):
                    if value is not _UNSET:
                        _set(msg, *value)
                else:
                    _set(msg, descriptor.fields_by_name[key], value)
            return msg

        return st.fixed_dictionaries(parts).map(build)

    def value(self, field: FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
        """The whole value of `field` (list for repeated, dict for map), or _UNSET for "leave it alone"."""
        key = (field.full_name, depth)
        if key not in self._values:
            self._values[key] = self._make_value(field, depth)
        return self._values[key]

    def _make_value(self, field: FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
        hint = self.hints.get(field.full_name, self.hints.get(field.name))
        if hint is not None:
            return hint
        if _is_map(field):
            key_field = field.message_type.fields_by_name["key"]
            value_field = field.message_type.fields_by_name["value"]
            if value_field.message_type is not None:
                if depth <= 0:
                    return st.just({})
                value = self.message(value_field.message_type, depth - 1)
            else:
                value = scalar(value_field)
            few = st.dictionaries(scalar(key_field), value, max_size=3)
            if key_field.type != _F.TYPE_STRING or value_field.type != _F.TYPE_STRING:
                return few
            return st.one_of(few, st.integers(60, 70).map(lambda n: {f"k{i}": "v" for i in range(n)}))
        if field.message_type is not None:
            if depth <= 0:
                return st.just(_UNSET)
            element = self.message(field.message_type, depth - 1)
        else:
            element = scalar(field)
        if field.is_repeated:
            # a few, or many copies of one (cheap to make, and crosses the "at most N" limits)
            many = st.tuples(element, st.sampled_from([64, 65])).map(lambda t: [t[0]] * t[1])
            return st.one_of(st.lists(element, max_size=3), many)
        if field.message_type is not None or _synthetic(field):
            return st.one_of(st.just(_UNSET), element)
        return element

    def mutations(self, seed: Message, depth: int | None = None) -> st.SearchStrategy[Message]:
        """Messages like `seed` (a valid request) with one field (or up to three) replaced by random values, or nested
        messages mutated in turn: the rest stays valid, so a call gets past validation to what lies behind it."""
        depth = self.depth if depth is None else depth
        if id(seed) not in self._mutations:
            self._mutations[id(seed)] = self._make_mutations(seed, depth)
        return self._mutations[id(seed)]

    def _make_mutations(self, seed: Message, depth: int) -> st.SearchStrategy[Message]:
        descriptor = seed.DESCRIPTOR
        fields = list(descriptor.fields)
        replacements = {}
        for field in fields:
            random = self.value(field, depth)
            if field.message_type is not None and not field.is_repeated and seed.HasField(field.name) and depth > 0:
                random = st.one_of(self.mutations(getattr(seed, field.name), depth - 1), random)
            elif field.type == _F.TYPE_STRING and not field.is_repeated and getattr(seed, field.name):
                random = st.one_of(spliced(getattr(seed, field.name)), random)
            replacements[field.name] = random
        one = st.sampled_from(fields).map(lambda f: [f])  # mostly one field: the rest gets the call through
        which = st.one_of(one, one, st.lists(st.sampled_from(fields), max_size=min(3, len(fields)),
                                             unique_by=lambda f: f.name))

        @st.composite
        def mutated(draw: st.DrawFn) -> Message:
            msg = type(seed)()
            msg.CopyFrom(seed)
            for field in draw(which):
                value = draw(replacements[field.name])
                msg.ClearField(field.name)
                _set(msg, field, value)
            return msg

        return mutated()


def spliced(seed: str) -> st.SearchStrategy[str]:
    """`seed` with a stretch of it replaced by text, a number or nothing: "xid=79" becomes "xid=inf" or "x=79"."""
    insert = st.one_of(st.floats().map(repr), st.integers().map(str), text(), st.just(""))

    def splice(args: tuple[int, int, str]) -> str:
        start, length, middle = args
        return seed[:start] + middle + seed[start + length:]

    return st.tuples(st.integers(0, len(seed)), st.integers(0, len(seed)), insert).map(splice)


def undecodable(valid: st.SearchStrategy[Message]) -> st.SearchStrategy[bytes]:
    """Bytes that are rarely a valid message: random ones, and valid encodings cut short or with bytes changed."""
    encoded = valid.map(lambda m: m.SerializeToString())

    def flip(args: tuple[bytes, int, int]) -> bytes:
        data, at, byte = args
        if not data:
            return bytes([byte])
        at %= len(data)
        return data[:at] + bytes([byte]) + data[at + 1:]

    return st.one_of(
        st.binary(min_size=1, max_size=64),
        st.tuples(encoded, st.integers(0, 10_000)).map(lambda t: t[0][: t[1] % max(1, len(t[0]))]),
        st.tuples(encoded, st.integers(0, 10_000), st.integers(0, 255)).map(flip),
        st.sampled_from([b"\xff", b"\x0a\xff\xff\xff\xff\x0f", b"\x0a\x05\xff\xfe\xfd\xfc\xfb", b"\x08" + b"\xff" * 11,
                         b"\x0f", b"\x07", b"\x0b"]),
    )


def unknown_field(size: int, number: int = 99_999) -> bytes:
    """A length-delimited unknown field of `size` payload bytes: appended to a valid encoding it still decodes,
    so it makes a message of any type as large as wanted."""
    return _varint((number << 3) | 2) + _varint(size) + b"u" * size


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)
