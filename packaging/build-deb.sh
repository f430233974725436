#!/bin/sh
# Build wagent_<version>_all.deb from this tree: `packaging/build-deb.sh [OUTDIR]` (default build/deb).
#
# The build runs in a copy of the tree, with packaging/deb as its debian/ directory, in a clean
# environment: a python3 earlier on PATH than Debian's (pyenv shims, a venv) would make pybuild
# build against the wrong interpreter, and PYTHONPATH would leak modules into the build.
set -eu

root=$(cd "$(dirname "$0")/.." && pwd)
outdir=${1:-$root/build/deb}
clean_path=/usr/sbin:/usr/bin:/sbin:/bin

die() { echo "build-deb: $*" >&2; exit 1; }

# One version everywhere: agent.__version__ (what `wagent --version` prints), pyproject.toml and
# the Debian changelog (native package: the Debian version is the upstream version).
py_version=$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' "$root/agent/__init__.py")
pyproject_version=$(sed -n 's/^version = "\(.*\)"$/\1/p' "$root/pyproject.toml" | head -n 1)
deb_version=$(PATH=$clean_path dpkg-parsechangelog -l "$root/packaging/deb/changelog" -S Version)
[ -n "$py_version" ] || die "no __version__ = \"...\" line in agent/__init__.py"
[ "$py_version" = "$pyproject_version" ] ||
    die "agent/__init__.py says $py_version but pyproject.toml says $pyproject_version; make them equal"
[ "$py_version" = "$deb_version" ] ||
    die "agent/__init__.py says $py_version but packaging/deb/changelog says $deb_version;" \
        "add a changelog entry: dch -c packaging/deb/changelog -v $py_version (package devscripts)"
ls "$root"/policies/*.yaml >/dev/null 2>&1 ||
    die "policies/ holds no *.yaml: the package ships the default policies from there"

work=$(mktemp -d "${TMPDIR:-/tmp}/wagent-deb.XXXXXX")
trap 'rm -rf "$work"' EXIT
trap 'exit 130' INT TERM
src="$work/wagent-$py_version"
mkdir "$src"
# Everything the build could need; not the venv, the VCS, caches, or earlier build output.
tar -C "$root" \
    --exclude=./.git --exclude=./.venv --exclude=./build --exclude=./dist --exclude=./tests \
    --exclude='*.egg-info' --exclude=__pycache__ --exclude='*.pyc' --exclude=.pytest_cache \
    --exclude=.ruff_cache --exclude=.pybuild --exclude=./packaging/deb --exclude=./.deps-stamp \
    -cf - . | tar -C "$src" -xf -
cp -a "$root/packaging/deb" "$src/debian"
# The packaging notes (the unit's choices, what purge keeps) go to /usr/share/doc/wagent.
cp "$root/packaging/README.md" "$src/debian/README.Debian"

(cd "$src" && env -i PATH="$clean_path" HOME="$work" LC_ALL=C.UTF-8 \
    ${DEB_BUILD_OPTIONS:+DEB_BUILD_OPTIONS="$DEB_BUILD_OPTIONS"} \
    dpkg-buildpackage -us -uc -b) >"$work/build.log" 2>&1 || {
    tail -n 60 "$work/build.log" >&2
    die "dpkg-buildpackage failed (last 60 lines above)"
}

mkdir -p "$outdir"
rm -f "$outdir"/wagent_*
mv "$work"/wagent_"$py_version"_all.deb "$work"/wagent_"$py_version"_*.buildinfo \
    "$work"/wagent_"$py_version"_*.changes "$outdir"/
cp "$work/build.log" "$outdir/build.log"
echo "$outdir/wagent_${py_version}_all.deb"
