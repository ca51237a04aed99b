"""The Chakra ET wire format at the byte level, shared by writer and reader.

Flint encodes and decodes ``et_def.proto`` messages by hand instead of going
through protobuf message objects: the writer must serialize millions of nodes
by splicing shared byte strings, and the reader must keep attributes it does
not know verbatim. Everything here follows the protobuf wire format exactly
(canonical proto3 encoding: fields in number order, zero scalars omitted,
packed repeated integers), so ``et_def_pb2.Node.SerializeToString`` of the
same content gives the same bytes; tests hold the two together.

Field numbers (``chakra/schema/protobuf/et_def.proto``):

- ``GlobalMetadata``: 1 version (string), 2 attr.
- ``Node``: 1 id, 2 name, 3 type, 4 ctrl_deps (packed), 5 data_deps (packed),
  6 start_time_micros, 7 duration_micros, 8 inputs, 9 outputs, 10 attr.
- ``AttributeProto``: 1 name, 2 doc_string, then the ``value`` oneof: 3 double,
  5 float, 7 int32, 9 int64, 11 uint32, 13 uint64, 15 sint32, 17 sint64,
  19 fixed32, 21 fixed64, 23 sfixed32, 25 sfixed64, 27 bool, 29 string,
  (even numbers are the list variants).
"""

from __future__ import annotations

import struct

from flint.errors import FlintError

METADATA_VERSION = "0.0.4"

_MASK64 = (1 << 64) - 1


class TraceError(FlintError):
    """A Chakra trace on disk (or its comm-group file) that Flint cannot use.

    The message names the file, the node id when there is one, and the problem.
    """


def varint(value: int) -> bytes:
    """Protobuf base-128 varint; negative values as 64-bit two's complement."""
    if 0 <= value < 128:
        return _SMALL[value]
    value &= _MASK64
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_SMALL = [bytes((i,)) for i in range(128)]


def key(field: int, wire_type: int) -> bytes:
    return varint((field << 3) | wire_type)


def length_delimited(field: int, payload: bytes) -> bytes:
    return key(field, 2) + varint(len(payload)) + payload


def record(payload: bytes) -> bytes:
    """One length-prefixed record of an ET file (protolib ``encodeMessage``)."""
    return varint(len(payload)) + payload


# -- AttributeProto ----------------------------------------------------------

_ATTR_FIELD_INT32 = 7
_ATTR_FIELD_INT64 = 9
_ATTR_FIELD_UINT64 = 13
_ATTR_FIELD_BOOL = 27
_ATTR_FIELD_STRING = 29


def _attr(name: str, value_field: int, wire_type: int, payload: bytes) -> bytes:
    body = length_delimited(1, name.encode()) + key(value_field, wire_type) + payload
    return length_delimited(10, body)


def attr_int64(name: str, value: int) -> bytes:
    return _attr(name, _ATTR_FIELD_INT64, 0, varint(int(value)))


def attr_int32(name: str, value: int) -> bytes:
    value = int(value)
    if not -(1 << 31) <= value < (1 << 31):
        raise FlintError(f"attribute {name}={value} does not fit in int32")
    return _attr(name, _ATTR_FIELD_INT32, 0, varint(value))


def attr_uint64(name: str, value: int) -> bytes:
    value = int(value)
    if value < 0:
        raise FlintError(f"attribute {name}={value} is negative but Chakra stores it as uint64")
    return _attr(name, _ATTR_FIELD_UINT64, 0, varint(value))


def attr_bool(name: str, value: bool) -> bytes:
    return _attr(name, _ATTR_FIELD_BOOL, 0, varint(1 if value else 0))


def attr_string(name: str, value: str) -> bytes:
    raw = value.encode()
    return _attr(name, _ATTR_FIELD_STRING, 2, varint(len(raw)) + raw)


def metadata_record(version: str = METADATA_VERSION) -> bytes:
    """The leading ``GlobalMetadata`` record of every ET file."""
    return record(length_delimited(1, version.encode()) if version else b"")


def packed(field: int, values) -> bytes:
    if len(values) == 0:
        return b""
    return length_delimited(field, b"".join(varint(int(v)) for v in values))


# -- decoding ----------------------------------------------------------------


class WireError(Exception):
    """Malformed protobuf bytes (turned into a :class:`TraceError` by callers)."""


def read_varint(buf, pos: int, end: int) -> tuple[int, int]:
    result = 0
    shift = 0
    while True:
        if pos >= end:
            raise WireError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift >= 70:
            raise WireError("varint longer than 10 bytes")


def iter_fields(buf, pos: int, end: int):
    """Yield ``(field, wire_type, value, start, stop)`` for each field in ``buf[pos:end]``.

    ``value`` is an int for varint/fixed fields and a ``(begin, end)`` slice
    for length-delimited ones; ``start``/``stop`` delimit the whole field.
    """
    while pos < end:
        start = pos
        tag, pos = read_varint(buf, pos, end)
        field, wt = tag >> 3, tag & 7
        if field == 0:
            raise WireError("field number 0")
        if wt == 0:
            value, pos = read_varint(buf, pos, end)
        elif wt == 2:
            n, pos = read_varint(buf, pos, end)
            if pos + n > end:
                raise WireError(f"field {field} declares {n} bytes, only {end - pos} remain")
            value = (pos, pos + n)
            pos += n
        elif wt == 1:
            if pos + 8 > end:
                raise WireError("truncated fixed64")
            value = struct.unpack_from("<Q", buf, pos)[0]
            pos += 8
        elif wt == 5:
            if pos + 4 > end:
                raise WireError("truncated fixed32")
            value = struct.unpack_from("<I", buf, pos)[0]
            pos += 4
        else:
            raise WireError(f"field {field} has unsupported wire type {wt}")
        yield field, wt, value, start, pos


def signed64(v: int) -> int:
    return v - (1 << 64) if v >= (1 << 63) else v


def signed32_from_varint(v: int) -> int:
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= (1 << 31) else v


def zigzag(v: int) -> int:
    return (v >> 1) ^ -(v & 1)


# AttributeProto scalar oneof fields -> their protobuf wire type (0 varint, 1 fixed64, 2 length-delimited, 5 fixed32).
_ATTR_WIRE_TYPES = {3: 1, 5: 5, 7: 0, 9: 0, 11: 0, 13: 0, 15: 0, 17: 0, 19: 5, 21: 1, 23: 5, 25: 1, 27: 0, 29: 2}


def decode_attr_value(buf, field: int, wt: int, value):
    """The Python value of an ``AttributeProto`` oneof member (scalars only).

    Returns ints for every integer/bool type, float for double/float, str for
    strings, a list for list variants, ``None`` for bytes. A wire type that
    does not match the field's declared type is a :class:`WireError`.
    """
    want = _ATTR_WIRE_TYPES.get(field)
    if want is not None and wt != want:
        raise WireError(f"attribute value field {field} has wire type {wt}, but its type needs wire type {want}")
    if field in (7, 9):
        return signed64(value) if field == 9 else signed32_from_varint(value)
    if field in (11, 13):
        return value
    if field in (15, 17):
        return zigzag(value)
    if field == 27:
        return int(bool(value))
    if field in (19, 21):
        return value
    if field == 23:
        return value - (1 << 32) if value >= (1 << 31) else value
    if field == 25:
        return signed64(value)
    if field == 3:
        return struct.unpack("<d", struct.pack("<Q", value))[0]
    if field == 5:
        return struct.unpack("<f", struct.pack("<I", value))[0]
    if field == 29:
        return bytes(buf[value[0] : value[1]]).decode("utf-8", errors="replace")
    return None
