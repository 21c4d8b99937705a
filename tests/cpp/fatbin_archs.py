"""Lists the GPU code in the CUDA fat binaries inside an object, archive or shared library:
one line per entry, "sm_<arch> <kind>" with kind ELF (SASS) or PTX. Used by the ctest
cuda_architectures (CUDA 13's toolkit here ships no cuobjdump).

A fat binary is a header (magic 0xBA55ED50, u16 version, u16 header size, u64 payload size)
followed by entries, each with its own header: u16 kind (1 PTX, 2 ELF), u16 version,
u32 header size, u64 payload size, ..., u32 arch at offset 28 (e.g. 90 for sm_90).

    python3 fatbin_archs.py FILE [--expect "75-real;80-real;90"]
"""
import struct
import sys

MAGIC = struct.pack("<I", 0xBA55ED50)
KINDS = {1: "PTX", 2: "ELF"}


def entries(data: bytes):
    pos = data.find(MAGIC)
    while pos != -1:
        _, _, hsize, fat_size = struct.unpack_from("<IHHQ", data, pos)
        start, end = pos + hsize, pos + hsize + fat_size
        p = start
        while p + 32 <= end:
            kind, _, ehsize, payload = struct.unpack_from("<HHIQ", data, p)
            if kind not in KINDS or ehsize < 32:
                break
            arch = struct.unpack_from("<I", data, p + 28)[0]
            yield arch, KINDS[kind]
            p += ehsize + payload
        pos = data.find(MAGIC, max(end, pos + 4))


def expected(spec: str):
    """CMake CUDA_ARCHITECTURES ("75-real;90", "90-virtual") -> {(arch, kind)}."""
    want = set()
    for item in filter(None, spec.split(";")):
        num, _, suffix = item.partition("-")
        arch = int(num.rstrip("a"))
        if suffix in ("", "real"):
            want.add((arch, "ELF"))
        if suffix in ("", "virtual"):
            want.add((arch, "PTX"))
    return want


def main(argv):
    with open(argv[1], "rb") as f:
        found = set(entries(f.read()))
    for arch, kind in sorted(found):
        print(f"sm_{arch} {kind}")
    if len(argv) > 3 and argv[2] == "--expect":
        want = expected(argv[3])
        missing = want - found
        if missing:
            print("missing: " + ", ".join(f"sm_{a} {k}" for a, k in sorted(missing)))
            return 1
        print(f"all of {argv[3]} present")
    return 0 if found else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
