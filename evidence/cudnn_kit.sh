#!/usr/bin/env bash
# One cuDNN release from PyPI on the GPU machine, which has no network and takes at most
# ~64 MiB of carried files a command: `pack` it here, carry its parts over a few commands,
# `stage` it there. Any version, several versions side by side.
#
#   pack VERSION   (repository root, a machine with PyPI) download nvidia-cudnn-cu13==VERSION
#                  (the CUDA 13 build, as the GPU machine's torch; a release without a cu13
#                  wheel is refused), keep the files below, as one tar.xz (x86 BCJ + LZMA2
#                  preset 9e, dictionary KIT_XZ_DICT_MIB, default 1024) cut into parts of
#                  KIT_PART_MIB (default 58) MiB: .gpu-kit-cudnn/SHORT/p1, p2, ... (one folder a
#                  command, each with the kit's MANIFEST.json: checksums of the parts, the
#                  archive and every file). Prints what each library weighs, raw and per
#                  compression method (also in .gpu-kit-cudnn/SHORT/SIZES.tsv; KIT_MEASURE=0
#                  skips all but the archive; KIT_METHODS picks from deflate bz2 xz xz-x86 zstd),
#                  and the staging commands. KIT_WHEEL=FILE packs a wheel already here.
#   plan [SHORT..] (here) the staging commands for the kits packed under .gpu-kit-cudnn: the
#                  parts of every kit named (default all), fitted into as few commands as the
#                  KIT_PART_MIB budget allows (a kit's last part shares a command with another's).
#   stage          (GPU machine, repository root) take the parts carried in this command (any
#                  kits), keep them in /tmp/cudnn-kit-parts across commands of one warm machine;
#                  once a kit is whole, check it against its manifest, unpack it (python3's
#                  stdlib only: tarfile + lzma) into /tmp/cudnn-SHORT/nvidia/cudnn/{lib,include},
#                  link the sibling nvidia/* folders of torch's CUDA wheels beside it (the
#                  libraries' RUNPATH, $ORIGIN/../../cu13/lib, finds NVRTC and cuBLAS there, as
#                  in a pip install), drop the parts. One line a kit: parts staged, or ready.
#                  KIT_TMP (default /tmp) moves both folders (tests).
#
# Names. VERSION is the wheel's (9.24.0.43: cuDNN 9.24.0, NVIDIA's build 43). SHORT is
# MAJOR.MINOR when the patch level is 0, else MAJOR.MINOR.PATCH: 9.24.0.43 -> 9.24,
# 9.24.1.1 -> 9.24.1, 9.28.1.4 -> 9.28.1 (two builds of one patch level share a SHORT; the
# newer pack replaces the older). The kit unpacks to /tmp/cudnn-SHORT/nvidia/cudnn, the folder
# of TE_GQA_FIX_CUDNN=strict:/tmp/cudnn-SHORT/nvidia/cudnn, which tests/gpu/builds.sh calls
# build cudnn + SHORT without its dots: cudnn924, cudnn9241, cudnn9281.
#
# What is kept: include/cudnn_version.h (te-gqa-fix reads the version there) and every
# lib/libcudnn*.so.9 of the wheel but the sub-libraries named in DROP, so a sub-library that a
# later release adds is kept until someone looks at it. Transformer Engine's fused attention
# is cudnn-frontend's SDPA graph: graph API calls (cudnnBackend*, cudnnCreate, cudnnSetStream,
# cudnnGetVersion: all exported by libcudnn_graph) through the shim libcudnn.so.9, which dlopens
# the sub-library of a function when it is first called. libcudnn_graph in turn dlopens the
# engine libraries by name: engines_precompiled, engines_runtime_compiled (the NVRTC-built
# SDPA/fMHA engines), engines_tensor_ir (9.21 on; it holds a cudnnTensorIrSdpaEngine, an SDPA
# engine with SM90 code paths) and heuristic (the ranking the frontend's heuristics query) --
# all kept: dropping any could change which engine TE runs.
# Dropped, because nothing on that path can reach them: the engine libraries' undefined
# symbols all bind to libcudnn_graph.so.9, and neither NEEDED entries nor name strings in
# libcudnn_graph or the engine libraries name them; only the shim does, for its own exports:
#   adv  legacy RNN, CTC and multi-head-attention API (cudnnMultiHeadAttnForward: not SDPA)
#   ext  the subquadratic-ops API (cudnnCausalConv1d*, 7 functions; 9.22 on)
# Kept although no SDPA engine is in them: ops (legacy tensor ops, norms, dropout) and cnn
# (legacy convolutions, which NEED ops). Something on the import of torch and TE loads
# libcudnn_cnn.so.9 by name: without it in the folder the loader takes the system's older
# one, which then fails against the newer libcudnn_graph ("undefined symbol
# _ZTVN5cudnn7backend12OperationSetE, version libcudnn_graph.so.9"), and TE does not import.
# KIT_DROP="adv ext ops cnn" reproduces that; KIT_DROP="adv" keeps ext too.
DROP=${KIT_DROP-"adv ext"}
set -uo pipefail
export DROP
exec python3 - "$@" <<'PY'
import base64, bz2, hashlib, json, lzma, os, re, shutil, subprocess, sys, tarfile, tempfile
import zipfile, zlib
from concurrent.futures import ProcessPoolExecutor

DIST = "nvidia-cudnn-cu13"
KIT = os.environ.get("KIT_DIR", ".gpu-kit-cudnn")
TMP = os.environ.get("KIT_TMP", "/tmp")
MIB = 1 << 20
PART = int(float(os.environ.get("KIT_PART_MIB", "58")) * MIB)
DICT = int(float(os.environ.get("KIT_XZ_DICT_MIB", "1024")) * MIB)
DROP = os.environ.get("DROP", "").split()
LIB, INC = "nvidia/cudnn/lib/", "nvidia/cudnn/include/"
HEADER = INC + "cudnn_version.h"
MAX_CARRY = 8  # paths one command may carry


def say(*a):
    print(*a, flush=True)


def die(msg):
    print(f"cudnn_kit: {msg}", file=sys.stderr)
    sys.exit(1)


def short_of(version):
    m = re.fullmatch(r"(\d+)\.(\d+)\.(\d+)(?:\.\d+)?", version)
    if not m:
        die(f"{version!r}: expected a wheel version such as 9.24.0.43")
    major, minor, patch = m.groups()
    return f"{major}.{minor}" + (f".{patch}" if int(patch) else "")


def build_name(short):
    return "cudnn" + short.replace(".", "")


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(MIB), b""):
            h.update(block)
    return h.hexdigest()


def mib(n):
    return f"{n / MIB:.1f} MiB"


def sub_library(name):
    """libcudnn_engines_precompiled.so.9 -> engines_precompiled; the shim libcudnn.so.9 -> ''."""
    m = re.fullmatch(r"libcudnn(?:_(\w+?))?\.so(?:\.\d+)*", name)
    return None if m is None else (m.group(1) or "")


# ------------------------------------------------------------------------------ measuring


def _count(compress, path):
    n = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(4 * MIB), b""):
            n += len(compress.compress(block))
    return n + len(compress.flush())


def measure(job):
    """Compressed size of one file by one method (None when the tool is missing)."""
    method, path = job
    if method == "deflate":  # what zip -9 stores
        return _count(zlib.compressobj(9, zlib.DEFLATED, -15), path)
    if method == "bz2":
        return _count(bz2.BZ2Compressor(9), path)
    if method == "xz":  # xz -9e
        return _count(lzma.LZMACompressor(preset=9 | lzma.PRESET_EXTREME), path)
    if method == "xz-x86":  # xz --x86 --lzma2=preset=9e
        lz = {"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME}
        return _count(lzma.LZMACompressor(filters=[{"id": lzma.FILTER_X86}, lz]), path)
    if method == "zstd":
        if not shutil.which("zstd"):
            return None
        cmd = ["zstd", "-q", "--ultra", "-22", "--long=31", "-T1", "-c", path]
        with subprocess.Popen(cmd, stdout=subprocess.PIPE) as p:
            n = sum(len(b) for b in iter(lambda: p.stdout.read(4 * MIB), b""))
        return n if p.returncode == 0 else None
    raise ValueError(method)


def compress_archive(src, dst):
    filters = [
        {"id": lzma.FILTER_X86},
        {"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME, "dict_size": DICT},
    ]
    c = lzma.LZMACompressor(format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, filters=filters)
    with open(src, "rb") as f, open(dst, "wb") as out:
        for block in iter(lambda: f.read(4 * MIB), b""):
            out.write(c.compress(block))
        out.write(c.flush())
    return os.path.getsize(dst)


# ----------------------------------------------------------------------------------- pack


def download(version, where):
    wheel = os.environ.get("KIT_WHEEL")
    if wheel:
        return wheel
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--platform", "manylinux_2_27_x86_64", "--platform", "manylinux_2_28_x86_64",
           "-d", where, f"{DIST}=={version}"]
    if subprocess.run(cmd).returncode != 0:
        die(f"no {DIST}=={version} wheel for Linux x86_64 on the index: {DIST} is cuDNN's CUDA 13 "
            f"build, which the GPU machine's torch needs (`pip index versions {DIST}` lists them)")
    found = [f for f in os.listdir(where) if f.endswith(".whl")]
    if len(found) != 1:
        die(f"expected one wheel in {where}, found {found}")
    return os.path.join(where, found[0])


def wheel_record(z):
    """path -> (sha256 hex, size) from the wheel's RECORD."""
    rec = next(n for n in z.namelist() if n.endswith(".dist-info/RECORD"))
    out = {}
    for line in z.read(rec).decode().splitlines():
        path, digest, size = (line.rsplit(",", 2) + ["", ""])[:3]
        if digest.startswith("sha256="):
            raw = base64.urlsafe_b64decode(digest[7:] + "=" * (-len(digest[7:]) % 4))
            out[path] = (raw.hex(), int(size))
    return out


def pack(version):
    if not version:
        die("usage: pack VERSION (e.g. 9.24.0.43)")
    short = short_of(version)
    work = tempfile.mkdtemp(prefix="cudnn-kit-", dir=os.environ.get("KIT_WORK"))
    try:
        wheel = download(version, work)
        say(f"{os.path.basename(wheel)}: {mib(os.path.getsize(wheel))}")
        z = zipfile.ZipFile(wheel)
        record = wheel_record(z)
        libs = [i for i in z.infolist() if i.filename.startswith(LIB)
                and sub_library(i.filename[len(LIB):]) is not None]
        kept = [i for i in libs if sub_library(i.filename[len(LIB):]) not in DROP]
        dropped = [i for i in libs if i not in kept]
        if not any(sub_library(i.filename[len(LIB):]) == "" for i in kept):
            die(f"{wheel}: no {LIB}libcudnn.so.9")
        if HEADER not in z.namelist():
            die(f"{wheel}: no {HEADER}, where te-gqa-fix reads the version")
        header = z.getinfo(HEADER)
        tree = os.path.join(work, "tree")
        files = []
        for info in sorted(kept + [header], key=lambda i: i.filename):
            path = z.extract(info, tree)
            digest, size = sha256_file(path), os.path.getsize(path)
            if record.get(info.filename, (digest, size)) != (digest, size):
                die(f"{info.filename}: does not match the wheel's RECORD")
            files.append({"path": info.filename, "size": size, "sha256": digest,
                          "wheel_deflate": info.compress_size})
        tar_path = os.path.join(work, "kit.tar")
        with tarfile.open(tar_path, "w", format=tarfile.GNU_FORMAT) as tar:
            for f in files:
                ti = tar.gettarinfo(os.path.join(tree, f["path"]), arcname=f["path"])
                ti.mode = 0o755 if "/lib/" in f["path"] else 0o644
                ti.uid = ti.gid = 0
                ti.uname = ti.gname = ""
                ti.mtime = 0
                with open(os.path.join(tree, f["path"]), "rb") as fh:
                    tar.addfile(ti, fh)

        methods = os.environ.get("KIT_METHODS", "deflate bz2 xz zstd").split()
        if os.environ.get("KIT_MEASURE", "1") == "0":
            methods = []
        jobs = [(m, os.path.join(tree, f["path"])) for f in files if "/lib/" in f["path"]
                for m in methods]
        jobs.sort(key=lambda j: -os.path.getsize(j[1]))
        archive = os.path.join(work, f"cudnn-{short}.tar.xz")
        with ProcessPoolExecutor(int(os.environ.get("KIT_JOBS", os.cpu_count() or 1))) as pool:
            archive_job = pool.submit(compress_archive, tar_path, archive)
            sizes = dict(zip(jobs, pool.map(measure, jobs)))
            archive_size = archive_job.result()
        say(f"archive: {os.path.getsize(tar_path)} bytes of tar -> {archive_size} "
            f"({mib(archive_size)}) xz x86+9e, dictionary {mib(DICT)}")

        out = os.path.join(KIT, short)
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        parts = []
        with open(archive, "rb") as f:
            for n, chunk in enumerate(iter(lambda: f.read(PART), b""), 1):
                name = f"cudnn-{short}.tar.xz.{n}"
                parts.append({"folder": f"p{n}", "name": name, "size": len(chunk),
                              "sha256": hashlib.sha256(chunk).hexdigest()})
        manifest = {
            "kit": 1, "dist": DIST, "version": version, "short": short,
            "build": build_name(short), "wheel": os.path.basename(wheel),
            "wheel_sha256": sha256_file(wheel), "dropped": [i.filename for i in dropped],
            "archive": {"name": f"cudnn-{short}.tar.xz", "size": archive_size,
                        "sha256": sha256_file(archive), "method": "tar.xz, x86 BCJ + LZMA2 9e",
                        "dict_size": DICT},
            "parts": parts, "files": files,
        }
        with open(archive, "rb") as f:
            for p in parts:
                os.makedirs(os.path.join(out, p["folder"]))
                with open(os.path.join(out, p["folder"], p["name"]), "wb") as fh:
                    fh.write(f.read(p["size"]))
                with open(os.path.join(out, p["folder"], "MANIFEST.json"), "w") as fh:
                    json.dump(manifest, fh, indent=1)

        # The table: every library of the wheel, raw and compressed per method.
        cols = ["file", "kept", "raw", "wheel-deflate"] + methods
        rows = []
        for i in sorted(libs, key=lambda i: i.filename):
            f = next((x for x in files if x["path"] == i.filename), None)
            row = [i.filename[len(LIB):], "yes" if f else "no", str(i.file_size),
                   str(i.compress_size)]
            row += [str(sizes.get((m, os.path.join(tree, i.filename)), "") or "-")
                    if f else "-" for m in methods]
            rows.append(row)
        kept_libs = [f for f in files if "/lib/" in f["path"]]
        total = ["KEPT TOTAL", "", str(sum(f["size"] for f in kept_libs)),
                 str(sum(f["wheel_deflate"] for f in kept_libs))]
        for m in methods:
            vals = [sizes.get((m, os.path.join(tree, f["path"]))) for f in kept_libs]
            total.append(str(sum(vals)) if all(v is not None for v in vals) else "-")
        rows.append(total)
        solid = (f"archive {manifest['archive']['name']}: {archive_size} bytes, the kept files "
                 f"as one tar, xz x86 BCJ + LZMA2 9e, dictionary {mib(DICT)}")
        with open(os.path.join(out, "SIZES.tsv"), "w") as fh:
            for r in [cols] + rows:
                fh.write("\t".join(r) + "\n")
            fh.write(f"# {solid}\n")
        say(f"\ncuDNN {short} ({DIST} {version}), sizes in bytes:")
        widths = [max(len(r[k]) for r in [cols] + rows if k < len(r)) for k in range(len(cols))]
        for r in [cols] + rows:
            say("  " + "  ".join(c.rjust(widths[k]) if k > 1 else c.ljust(widths[k])
                               for k, c in enumerate(r)))
        say(f"  {solid}")
        say(f"\n{len(parts)} parts in {out}/: "
            + ", ".join(f"{p['folder']} {mib(p['size'])}" for p in parts))
        plan([short])
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ----------------------------------------------------------------------------------- plan


def manifests():
    """SHORT -> its manifest, from the part folders under KIT."""
    found = {}
    if os.path.isdir(KIT):
        for short in sorted(os.listdir(KIT)):
            if not os.path.isdir(os.path.join(KIT, short)):
                continue
            for folder in sorted(os.listdir(os.path.join(KIT, short))):
                path = os.path.join(KIT, short, folder, "MANIFEST.json")
                if os.path.isfile(path):
                    with open(path) as f:
                        found.setdefault(short, json.load(f))
    return found


def plan(shorts=()):
    kits = manifests()
    shorts = list(shorts) or list(kits)
    if not shorts:
        die(f"no kit under {KIT}/ (pack one first)")
    missing = [s for s in shorts if s not in kits]
    if missing:
        die(f"no kit for {' '.join(missing)} under {KIT}/ (pack it first)")
    items = [(p["size"], s, f"{KIT}/{s}/{p['folder']}") for s in shorts for p in kits[s]["parts"]]
    bins = []  # first fit, largest first: a kit's last part rides along with another's
    for size, short, path in sorted(items, key=lambda x: -x[0]):
        for b in bins:
            if b["size"] + size <= PART and len(b["carry"]) < MAX_CARRY:
                break
        else:
            b = {"size": 0, "carry": [], "kits": set()}
            bins.append(b)
        b["size"] += size
        b["carry"].append(path)
        b["kits"].add(short)
    # In kit order, so each kit is whole as early as it can be: its own parts, then the
    # command its last part shares.
    order = []
    for s in shorts:
        mine = [b for b in bins if s in b["kits"] and b not in order]
        order += sorted(mine, key=lambda b: len(b["kits"]))
    counts = ", ".join(f"cuDNN {s} = {len(kits[s]['parts'])} parts" for s in shorts)
    say(f"\nstaging ({counts}): {len(bins)} commands, each `bash evidence/cudnn_kit.sh stage` "
        "from the repository root, carrying:")
    done = set()
    for n, b in enumerate(order, 1):
        done |= {s for s in b["kits"] if all(
            any(f"{KIT}/{s}/{p['folder']}" in c["carry"] for c in order[:n])
            for p in kits[s]["parts"])}
        whole = [s for s in shorts if s in done and s in b["kits"]]
        say(f"  {n}. {mib(b['size']):>9}  carry {json.dumps(sorted(b['carry']))}"
            + (f"  -> cuDNN {', '.join(whole)} ready" if whole else ""))
    for s in shorts:
        refused = tuple(map(int, s.split(".")[:2])) < (9, 18)
        say(f"  then cuDNN {s} is TE_GQA_FIX_CUDNN=strict:/tmp/cudnn-{s}/nvidia/cudnn, "
            f"build {kits[s]['build']} (tests/gpu/builds.sh)"
            + (": te-gqa-fix's route refuses cuDNN below 9.18" if refused else ""))


# ---------------------------------------------------------------------------------- stage


class Joined:
    """The parts of one archive read as one file, hashed on the way."""

    def __init__(self, paths):
        self.paths, self.f, self.hash = list(paths), None, hashlib.sha256()

    def read(self, n=-1):
        out = b""
        while n < 0 or len(out) < n:
            if self.f is None:
                if not self.paths:
                    break
                self.f = open(self.paths.pop(0), "rb")
            block = self.f.read(-1 if n < 0 else n - len(out))
            if not block:
                self.f.close()
                self.f = None
                continue
            out += block
        self.hash.update(out)
        return out


def link_siblings(nvidia_dir):
    """The nvidia/* folders of torch's CUDA wheels beside our nvidia/cudnn, as pip lays them."""
    try:
        import nvidia  # namespace package of the nvidia-* wheels
        roots = list(nvidia.__path__)
    except ImportError:
        return 0
    n = 0
    for root in roots:
        for name in sorted(os.listdir(root)):
            src, dst = os.path.join(root, name), os.path.join(nvidia_dir, name)
            if name != "cudnn" and os.path.isdir(src) and not os.path.lexists(dst):
                os.symlink(src, dst)
                n += 1
    return n


def unpack(m, store, out):
    """Check and unpack a whole kit into out; raises ValueError on any mismatch."""
    want = {f["path"]: f for f in m["files"]}
    partial = out + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    src = Joined(os.path.join(store, p["name"]) for p in m["parts"])
    seen = set()
    with tarfile.open(fileobj=src, mode="r|xz") as tar:
        for member in tar:
            f = want.get(member.name)
            if f is None or not member.isfile() or member.name in seen:
                raise ValueError(f"unexpected member {member.name!r} in the archive")
            dst = os.path.join(partial, member.name)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            h = hashlib.sha256()
            with tar.extractfile(member) as r, open(dst, "wb") as w:
                for block in iter(lambda: r.read(4 * MIB), b""):
                    h.update(block)
                    w.write(block)
            if h.hexdigest() != f["sha256"]:
                raise ValueError(f"{member.name}: sha256 differs from the manifest")
            os.chmod(dst, member.mode)
            seen.add(member.name)
    src.read()  # the rest, so the hash covers every byte
    if src.hash.hexdigest() != m["archive"]["sha256"]:
        raise ValueError("the joined parts' sha256 differs from the manifest")
    if seen != set(want):
        raise ValueError(f"files missing from the archive: {sorted(set(want) - seen)}")
    linked = link_siblings(os.path.join(partial, "nvidia"))
    with open(os.path.join(partial, ".kit.json"), "w") as fh:
        json.dump({k: m[k] for k in ("version", "short", "build", "wheel", "wheel_sha256")}
                  | {"archive_sha256": m["archive"]["sha256"], "linked": linked}, fh, indent=1)
    shutil.rmtree(out, ignore_errors=True)
    os.rename(partial, out)


def ready_kit(out):
    try:
        with open(os.path.join(out, ".kit.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def stage():
    stores = os.path.join(TMP, "cudnn-kit-parts")
    bad = 0
    # 1. Take the carried parts (checked one by one, so a bad copy is named at once).
    for short, m in manifests().items():
        out = os.path.join(TMP, f"cudnn-{short}")
        done = ready_kit(out)
        if done and done.get("archive_sha256") == m["archive"]["sha256"]:
            continue
        store = os.path.join(stores, short)
        old = os.path.join(store, "MANIFEST.json")
        if os.path.isfile(old):
            with open(old) as f:
                if json.load(f)["archive"]["sha256"] != m["archive"]["sha256"]:
                    shutil.rmtree(store)  # parts of another pack of this SHORT: start over
        os.makedirs(store, exist_ok=True)
        with open(old, "w") as f:
            json.dump(m, f)
        for p in m["parts"]:
            src = os.path.join(KIT, short, p["folder"], p["name"])
            dst = os.path.join(store, p["name"])
            if not os.path.isfile(src) or os.path.isfile(dst):
                continue
            if sha256_file(src) != p["sha256"]:
                say(f"cuDNN {short}: {src} does not match its checksum; not taken")
                bad += 1
                continue
            shutil.copyfile(src, dst + ".tmp")
            os.rename(dst + ".tmp", dst)
    # 2. Unpack the kits that are whole; one line a kit.
    shorts = set(os.listdir(stores)) if os.path.isdir(stores) else set()
    shorts |= {d[len("cudnn-"):] for d in os.listdir(TMP) if d.startswith("cudnn-")
               and ready_kit(os.path.join(TMP, d))}
    for short in sorted(shorts):
        out = os.path.join(TMP, f"cudnn-{short}")
        store = os.path.join(stores, short)
        mf = os.path.join(store, "MANIFEST.json")
        if os.path.isfile(mf):
            with open(mf) as f:
                m = json.load(f)
            have = [p for p in m["parts"] if os.path.isfile(os.path.join(store, p["name"]))]
            if len(have) == len(m["parts"]):
                try:
                    unpack(m, store, out)
                    shutil.rmtree(store)
                except (ValueError, OSError, EOFError, lzma.LZMAError, tarfile.TarError) as e:
                    say(f"cuDNN {short} ({m['version']}): unpack failed: {e}")
                    shutil.rmtree(out + ".partial", ignore_errors=True)
                    bad += 1
                    continue
            else:
                say(f"cuDNN {short} ({m['version']}): {len(have)}/{len(m['parts'])} parts staged "
                    f"({' '.join(p['folder'] for p in have) or 'none'}), waiting for "
                    f"{' '.join(p['folder'] for p in m['parts'] if p not in have)}")
                continue
        done = ready_kit(out)
        if done:
            lib = os.path.join(out, LIB)
            say(f"cuDNN {short} ({done['version']}): ready, {len(os.listdir(lib))} libraries: "
                f"TE_GQA_FIX_CUDNN=strict:{os.path.join(out, 'nvidia', 'cudnn')} "
                f"(build {done['build']})")
    if not shorts:
        say(f"no cuDNN kit parts carried (expected {KIT}/SHORT/pN/) and none staged in {TMP}")
    return 1 if bad else 0


cmd, args = (sys.argv[1:2] or [""])[0], sys.argv[2:]
if cmd == "pack":
    pack(args[0] if args else "")
elif cmd == "plan":
    plan(args)
elif cmd == "stage":
    sys.exit(stage())
else:
    die("usage: cudnn_kit.sh pack VERSION | plan [SHORT..] | stage")
PY
