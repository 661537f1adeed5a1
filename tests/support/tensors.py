"""Reads safetensors files with numpy alone, for the multi-process test scripts.

Why not safetensors.torch: importing torch costs ~4 s of CPU per Python start on the test
machines, and the scripts compare two runs' weights ~80 times (zero_test.sh alone ~50), which
was a third of the suite's time. numpy starts in ~0.25 s. safetensors.numpy cannot return
bfloat16 (numpy has no such type), so the file is read here by the format's own definition: an
8-byte little-endian header length, a JSON header of {name: {dtype, shape, data_offsets}}, then
the tensors' bytes; bfloat16 is widened exactly to float32 (its 16 bits are float32's top half).
The tests that check Python's safetensors reads loom's files still use the reference reader.

usage: tensors.py compare A.safetensors B.safetensors TOLERANCE
         prints "worst relative difference X[, bitwise]"; exits 1 when X > TOLERANCE
       tensors.py shape FILE NAME
         prints the tensor's shape as comma-separated integers
       tensors.py metadata FILE KEY
         prints the header's __metadata__ value of KEY (empty when it has none)
"""
import json
import sys

import numpy as np

_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64,
           "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


def load(path):
    """{name: numpy array} of a safetensors file; BF16 tensors come back as exact float32."""
    with open(path, "rb") as f:
        data = f.read()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    body = memoryview(data)[8 + n:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        raw = body[begin:end]
        if info["dtype"] == "BF16":
            array = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            array = np.frombuffer(raw, dtype=np.dtype(_DTYPES[info["dtype"]]).newbyteorder("<"))
        out[name] = array.reshape(info["shape"])
    return out


def compare(path_a, path_b, tolerance):
    a, b = load(path_a), load(path_b)
    if a.keys() != b.keys():
        print(f"different tensors: {sorted(a.keys() ^ b.keys())}")
        return 1
    worst = 0.0
    bitwise = True
    for name in a:
        x, y = a[name].astype(np.float64), b[name].astype(np.float64)
        if x.shape != y.shape:
            print(f"{name}: shapes {x.shape} and {y.shape}")
            return 1
        worst = max(worst, float(np.linalg.norm(x - y) / max(np.linalg.norm(x), 1e-12)))
        bitwise = bitwise and bool(np.array_equal(a[name], b[name]))  # as torch's (a == b).all()
    print(f"worst relative difference {worst:.1e}{', bitwise' if bitwise else ''}")
    return 0 if worst <= tolerance else 1


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "compare":
        sys.exit(compare(sys.argv[2], sys.argv[3], float(sys.argv[4])))
    if len(sys.argv) == 4 and sys.argv[1] == "metadata":
        with open(sys.argv[2], "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        print(header.get("__metadata__", {}).get(sys.argv[3], ""))
        sys.exit(0)
    if len(sys.argv) == 4 and sys.argv[1] == "shape":
        print(",".join(str(d) for d in load(sys.argv[2])[sys.argv[3]].shape))
        sys.exit(0)
    sys.exit(__doc__)
