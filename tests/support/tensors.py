"""Reads safetensors files with Python's standard library alone, for the test scripts.

Why not safetensors.torch, nor numpy: importing torch costs ~4 s of CPU per Python start on
the test machines, numpy ~0.25 s (~1 s on a loaded 2-core machine), and the scripts compare two
runs' weights ~100 times (zero_test.sh alone ~80): the interpreter's start was most of each
comparison. The models compared are the tests' tiny ones (10^4 to 10^6 elements), for which a
loop over the values costs milliseconds. So the file is read here by the format's own
definition: an 8-byte little-endian header length, a JSON header of {name: {dtype, shape,
data_offsets}}, then the tensors' little-endian bytes; bfloat16 is widened exactly to float32
(its 16 bits are float32's top half), float16 exactly by struct's 'e'. Sums are math.fsum's,
exactly rounded. The tests that check Python's safetensors reads loom's files still use the
reference reader.

usage: tensors.py compare A.safetensors B.safetensors TOLERANCE
         prints "worst relative difference X[, bitwise]"; exits 1 when X > TOLERANCE
       tensors.py shape FILE NAME
         prints the tensor's shape as comma-separated integers
       tensors.py metadata FILE KEY
         prints the header's __metadata__ value of KEY (empty when it has none)
"""
import array
import json
import math
import struct
import sys

# safetensors dtype -> array typecode of the same size (checked below: 'i' and 'q' are 4 and 8
# bytes on every platform CPython's tests run on, but the check costs nothing)
_TYPECODES = {"F64": "d", "F32": "f", "I64": "q", "I32": "i", "I16": "h", "I8": "b", "U8": "B",
              "BOOL": "B"}
_SIZES = {"F64": 8, "F32": 4, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def _values(dtype, raw):
    """The tensor's elements, flat, as Python numbers (floats exact)."""
    if dtype == "F16":
        return struct.unpack(f"<{len(raw) // 2}e", raw)
    if dtype == "BF16":
        half = array.array("H")
        half.frombytes(raw)  # array("H", raw) would take a memoryview's bytes one by one
        if sys.byteorder == "big":
            half.byteswap()
        return array.array("f", array.array("I", (h << 16 for h in half)).tobytes())
    code = _TYPECODES.get(dtype)
    if code is None:
        sys.exit(f"tensors.py: dtype {dtype} is not read here; add it to _TYPECODES")
    values = array.array(code)
    values.frombytes(raw)
    assert values.itemsize == _SIZES[dtype], (dtype, values.itemsize)
    if sys.byteorder == "big":
        values.byteswap()
    return values


def header(path):
    with open(path, "rb") as f:
        return json.loads(f.read(int.from_bytes(f.read(8), "little")))


def load(path):
    """{name: (shape, flat values)} of a safetensors file; BF16 and F16 come back exact."""
    with open(path, "rb") as f:
        data = f.read()
    n = int.from_bytes(data[:8], "little")
    body = memoryview(data)[8 + n:]
    out = {}
    for name, info in json.loads(data[8:8 + n]).items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        out[name] = (list(info["shape"]), _values(info["dtype"], body[begin:end]))
    return out


def compare(path_a, path_b, tolerance):
    a, b = load(path_a), load(path_b)
    if a.keys() != b.keys():
        print(f"different tensors: {sorted(a.keys() ^ b.keys())}")
        return 1
    worst = 0.0
    bitwise = True
    for name in a:
        (shape_a, x), (shape_b, y) = a[name], b[name]
        if shape_a != shape_b:
            print(f"{name}: shapes {tuple(shape_a)} and {tuple(shape_b)}")
            return 1
        difference = math.sqrt(math.fsum((float(p) - float(q)) ** 2 for p, q in zip(x, y)))
        norm = math.sqrt(math.fsum(float(p) ** 2 for p in x))
        relative = difference / max(norm, 1e-12)
        worst = max(worst, math.inf if math.isnan(relative) else relative)  # NaN fails
        bitwise = bitwise and all(p == q for p, q in zip(x, y))  # as torch's (a == b).all()
    print(f"worst relative difference {worst:.1e}{', bitwise' if bitwise else ''}")
    return 0 if worst <= tolerance else 1


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "compare":
        sys.exit(compare(sys.argv[2], sys.argv[3], float(sys.argv[4])))
    if len(sys.argv) == 4 and sys.argv[1] == "metadata":
        print(header(sys.argv[2]).get("__metadata__", {}).get(sys.argv[3], ""))
        sys.exit(0)
    if len(sys.argv) == 4 and sys.argv[1] == "shape":
        print(",".join(str(d) for d in header(sys.argv[2])[sys.argv[3]]["shape"]))
        sys.exit(0)
    sys.exit(__doc__)
