#!/usr/bin/env bash
# Build the project's image with a real container engine and run the pipeline in it (issue #47).
#
#   scripts/docker-check.sh [--file DOCKERFILE] [--tag NAME] [--report FILE.json]
#
# - engine: docker where its daemon answers, else podman (Debian's podman, runc and debootstrap are
#   installed with apt-get when missing and this runs as root); with neither it prints one
#   "docker-check: skipped: ..." line and exits 0.
# - base: $BASE when set; else python:3.11-slim-bookworm when present or pullable; else a local
#   Debian bookworm base (debootstrap --variant=minbase, imported as localhost/batchlab-base:bookworm,
#   built once and reused), passed as --build-arg BASE.
# - pip: the build sees the pip configuration of this machine (`pip config list`, files and PIP_*
#   variables, written into one pip.conf) and the local paths it names (wheel folders, file://
#   indexes, constraints, CA bundle) as read-only build mounts (podman build -v); nothing of it is
#   baked into the image, and the check verifies that. Docker has no build mounts: there the
#   build uses the image's own pip set-up.
# - podman quirks handled here, not in the Dockerfile: the runc runtime where it is installed
#   (crun refuses hybrid cgroups) and lower limits than podman's defaults (nofile 20000, nproc 4096).
# - checks: the image's default command (make run) exits 0 as the non-root user, reports/metrics.json
#   and models/model.onnx are there, `batchlab predict` runs on the exported model, `dvc status` is
#   clean inside; prints the build time, the image size and the run time.
# A failure prints "docker-check: FAIL: ..." with the engine's own error line and exits 1.
set -euo pipefail

die() { echo "docker-check: $*" >&2; exit 2; }
fail() { echo "docker-check: FAIL: $*" >&2; exit 1; }
say() { echo "docker-check: $*"; }

REPO=$(cd "$(dirname "$0")/.." && pwd)
DOCKERFILE=$REPO/Dockerfile
TAG=batchlab:check
REPORT=""
while [ $# -gt 0 ]; do
  case $1 in
    --file|--tag|--report) [ $# -ge 2 ] && [ -n "$2" ] || die "$1 needs a value"
      case $1 in --file) DOCKERFILE=$2 ;; --tag) TAG=$2 ;; --report) REPORT=$2 ;; esac
      shift 2 ;;
    -h|--help) sed -n '2,4p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument '$1' (usage: scripts/docker-check.sh [--file DOCKERFILE] [--tag NAME] [--report FILE.json])" ;;
  esac
done
[ -f "$DOCKERFILE" ] || die "no Dockerfile at '$DOCKERFILE'"
DOCKERFILE=$(cd "$(dirname "$DOCKERFILE")" && pwd)/$(basename "$DOCKERFILE")
[[ $TAG =~ ^[a-z0-9][a-z0-9._/-]*(:[A-Za-z0-9._-]+)?$ ]] || die "'$TAG' is not an image name (lower-case name[:tag])"
if [ -n "$REPORT" ]; then
  [ -d "$(dirname "$REPORT")" ] || die "no folder for the report '$REPORT'"
fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/docker-check.XXXXXX")
CONTAINER=batchlab-check-$$
RAN_IMAGE=localhost/batchlab-check-ran:$$
cleanup() {
  "${ENGINE:-true}" rm -f "$CONTAINER" >/dev/null 2>&1 || true
  "${ENGINE:-true}" rmi -f "$RAN_IMAGE" >/dev/null 2>&1 || true
  rm -rf "$WORK"
}
trap cleanup EXIT

# --- the engine --------------------------------------------------------------------------------
ENGINE=""
if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
  ENGINE=docker
elif command -v podman >/dev/null 2>&1; then
  ENGINE=podman
elif [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  say "installing podman and runc (apt-get)"
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman runc >/dev/null; }; then
    echo "docker-check: skipped: no container engine, and apt-get could not install podman"
    exit 0
  fi
  ENGINE=podman
else
  echo "docker-check: skipped: no container engine (docker daemon or podman) and none can be installed here"
  exit 0
fi
RUN_FLAGS=()
if [ "$ENGINE" = podman ]; then
  command -v runc >/dev/null 2>&1 && RUN_FLAGS+=(--runtime runc)
  RUN_FLAGS+=(--ulimit nofile=20000:20000 --ulimit nproc=4096:4096)
fi
say "engine: $ENGINE $("$ENGINE" --version | head -n 1) ${RUN_FLAGS[*]}"

have_image() { "$ENGINE" image inspect "$1" >/dev/null 2>&1; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.0f", b - a }'; }

# --- the base image ----------------------------------------------------------------------------
LOCAL_BASE=localhost/batchlab-base:bookworm
REGISTRY_BASE=docker.io/library/python:3.11-slim-bookworm
base_s=""
if [ -n "${BASE:-}" ]; then
  :
elif have_image "$REGISTRY_BASE"; then
  BASE=$REGISTRY_BASE
elif have_image "$LOCAL_BASE"; then
  BASE=$LOCAL_BASE
elif timeout 60 "$ENGINE" pull -q "$REGISTRY_BASE" >"$WORK/pull.log" 2>&1; then
  BASE=$REGISTRY_BASE
else
  say "no registry base ($(tail -n 1 "$WORK/pull.log" | cut -c1-160)); building $LOCAL_BASE with debootstrap"
  t0=$(now)
  [ "$(id -u)" = 0 ] || fail "debootstrap needs root to build the local base; pass BASE=an image you have"
  if ! command -v debootstrap >/dev/null 2>&1; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null; } \
      || fail "apt-get could not install debootstrap"
  fi
  # the mirror this machine's apt uses, else Debian's default
  mirror=$(grep -h -o -E '^(URIs:|deb) +https?://[^ ]+/debian/?( |$)' /etc/apt/sources.list /etc/apt/sources.list.d/* 2>/dev/null \
    | head -n 1 | awk '{print $2}' || true)
  mirror=${MIRROR:-${mirror:-http://deb.debian.org/debian}}
  debootstrap --variant=minbase bookworm "$WORK/rootfs" "$mirror" >"$WORK/debootstrap.log" 2>&1 \
    || fail "debootstrap: $(tail -n 1 "$WORK/debootstrap.log")"
  rm -rf "$WORK"/rootfs/var/cache/apt/archives/*.deb "$WORK"/rootfs/var/lib/apt/lists/*
  tar -C "$WORK/rootfs" --numeric-owner -cf "$WORK/rootfs.tar" .
  rm -rf "$WORK/rootfs"
  "$ENGINE" import "$WORK/rootfs.tar" "$LOCAL_BASE" >/dev/null 2>"$WORK/import.log" || fail "$ENGINE import of the debootstrap tree failed"
  rm -f "$WORK/rootfs.tar"
  BASE=$LOCAL_BASE
  base_s=$(since "$t0")
  say "local base built in ${base_s} s from $mirror"
fi
say "base: $BASE"

# --- pip as this machine has it, as read-only build mounts --------------------------------------
BUILD_FLAGS=(--build-arg "BASE=$BASE")
if [ "$ENGINE" = podman ]; then
  BUILD_FLAGS+=("${RUN_FLAGS[@]}")
  pip_list=$(python3 -m pip config list 2>/dev/null || true)
  if [ -n "$pip_list" ]; then
    # scope.key='value' lines; the PIP_* variables (:env:) override the files, as for pip itself
    # the files it names (constraints, CA bundle) are copied beside it and the copy is mounted as the
    # site configuration folder /etc/xdg/pip (not over the image's own files: apt's ca-certificates
    # writes /etc/ssl/certs); the folders it names are mounted where they are (a file:// index with
    # its parent, where its pages' relative links lead)
    mkdir "$WORK/pip"
    printf '%s\n' "$pip_list" | python3 -c '
import configparser, os, re, shutil, sys
site, out = sys.argv[1], sys.argv[2]
conf = configparser.ConfigParser(interpolation=None)
env = {}
for line in sys.stdin:
    m = re.match(r"^([^.]*)\.([^=]+)=(.*)$", line.strip())
    if not m:
        continue
    scope, key, value = m.group(1), m.group(2), m.group(3).strip().strip("\x27\"")
    if scope == ":env:":
        env[key] = value
    else:
        conf.setdefault(scope, {})[key] = value
conf.setdefault("global", {})
for key, value in env.items():
    conf["global"][key] = value
folders = set()
for section in conf.sections():
    for key, value in conf[section].items():
        words = []
        for word in value.split():
            path = word[len("file://"):] if word.startswith("file://") else word
            if path.startswith("/") and os.path.isfile(path):
                name = f"{len(os.listdir(out))}-{os.path.basename(path)}"
                shutil.copyfile(path, os.path.join(out, name))
                word = word.replace(path, f"{site}/{name}")
            elif path.startswith("/") and os.path.isdir(path):
                folder = path.rstrip("/") or "/"
                if word.startswith("file://") and os.path.dirname(folder) != "/":
                    folder = os.path.dirname(folder)  # an index: its pages link to ../../files/
                folders.add(folder)
            words.append(word)
        conf[section][key] = " ".join(words)
with open(os.path.join(out, "pip.conf"), "w") as conf_file:
    conf.write(conf_file)
print("\n".join(sorted(folders)))
' /etc/xdg/pip "$WORK/pip" >"$WORK/pip-folders"
    BUILD_FLAGS+=(-v "$WORK/pip:/etc/xdg/pip:ro")
    while IFS= read -r path; do
      [ -n "$path" ] && BUILD_FLAGS+=(-v "$path:$path:ro")
    done <"$WORK/pip-folders"
    say "pip for the build: this machine's configuration as /etc/xdg/pip/pip.conf, $(ls "$WORK/pip" | paste -sd' ') and $(paste -sd' ' "$WORK/pip-folders") mounted read-only"
  fi
fi

# --- build ---------------------------------------------------------------------------------------
say "building $TAG from $DOCKERFILE"
t0=$(now)
set +e
"$ENGINE" build "${BUILD_FLAGS[@]}" -f "$DOCKERFILE" -t "$TAG" "$REPO" 2>&1 | tee "$WORK/build.log"
rc=${PIPESTATUS[0]}
set -e
build_s=$(since "$t0")
if [ "$rc" != 0 ]; then
  line=$(grep -E -i '^(error|Error:)|error building|failed to' "$WORK/build.log" | tail -n 1)
  fail "build exited $rc after ${build_s} s: ${line:-$(tail -n 1 "$WORK/build.log")}"
fi
size_b=$("$ENGINE" image inspect --format '{{.Size}}' "$TAG")
size_mb=$(awk -v b="$size_b" 'BEGIN { printf "%.0f", b / 1e6 }')
say "built in ${build_s} s; image size ${size_mb} MB"

# --- the image's default command (make run) ----------------------------------------------------
say "running the image's default command: $("$ENGINE" image inspect --format '{{json .Config.Cmd}}' "$TAG") as user $("$ENGINE" image inspect --format '{{.Config.User}}' "$TAG")"
t0=$(now)
set +e
"$ENGINE" run "${RUN_FLAGS[@]}" --name "$CONTAINER" "$TAG" 2>&1 | tee "$WORK/run.log"
rc=${PIPESTATUS[0]}
set -e
run_s=$(since "$t0")
if [ "$rc" != 0 ]; then
  line=$(grep -E -i '^(error|Error:)|error' "$WORK/run.log" | tail -n 1)
  fail "the default command exited $rc after ${run_s} s: ${line:-$(tail -n 1 "$WORK/run.log")}"
fi
say "default command done in ${run_s} s"

# --- inside the container as it was left: user, outputs, predict, dvc status ------------------
"$ENGINE" commit -q "$CONTAINER" "$RAN_IMAGE" >/dev/null
t0=$(now)
set +e
"$ENGINE" run "${RUN_FLAGS[@]}" --rm "$RAN_IMAGE" sh -ec '
  test "$(id -u)" != 0 || { echo "runs as root"; exit 1; }
  echo "user: $(id -un) ($(id -u))"
  for f in reports/metrics.json models/model.onnx; do
    test -s "$f" || { echo "missing: $f"; exit 1; }
    test "$(stat -c %u "$f")" = "$(id -u)" || { echo "$f is not owned by $(id -un)"; exit 1; }
    echo "made: $f ($(stat -c %s "$f") bytes, owner $(stat -c %U "$f"))"
  done
  batchlab predict --model models/model.onnx --input data/prepared/examples.csv --output /tmp/predictions.csv
  test -s /tmp/predictions.csv || { echo "predict wrote nothing"; exit 1; }
  echo "predict: $(($(wc -l </tmp/predictions.csv) - 1)) rows"
  status=$(dvc status 2>&1); echo "dvc status: $status"
  case $status in *"Data and pipelines are up to date"*) ;; *) echo "dvc status is not clean"; exit 1 ;; esac
  test ! -s /etc/xdg/pip/pip.conf || { echo "the build left a pip configuration in the image"; exit 1; }
' 2>&1 | tee "$WORK/checks.log"
rc=${PIPESTATUS[0]}
set -e
checks_s=$(since "$t0")
[ "$rc" = 0 ] || fail "inside the image: $(tail -n 1 "$WORK/checks.log")"

say "PASS: engine $ENGINE, base $BASE${base_s:+ (local base ${base_s} s)}, build ${build_s} s, image ${size_mb} MB, make run ${run_s} s, checks ${checks_s} s"
if [ -n "$REPORT" ]; then
  tmp=$(mktemp "$(dirname "$REPORT")/.docker-check.XXXXXX")
  printf '{"engine": "%s", "base": "%s", "base_seconds": %s, "build_seconds": %s, "image_bytes": %s, "run_seconds": %s, "checks_seconds": %s}\n' \
    "$ENGINE" "$BASE" "${base_s:-0}" "$build_s" "$size_b" "$run_s" "$checks_s" >"$tmp"
  mv -f "$tmp" "$REPORT"
fi
