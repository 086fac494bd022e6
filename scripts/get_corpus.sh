#!/usr/bin/env bash
# scripts/get_corpus.sh: builds the real-text corpus of the language-modelling experiments (results/
# extrapolation.md, results/conversion.md): the C sources (.c, .h) of Debian's linux-source package, as one
# training file and one validation file. Nothing is downloaded but the Debian package; nothing enters git.
#
#   bash scripts/get_corpus.sh [DATA_DIR]     (default: $PATHATTN_DATA, else ~/.cache/pathattn/linux-c)
#
# Split rule (fixed): every .c / .h file of the source tree, by its path relative to the tree's top,
# sorted bytewise (LC_ALL=C); file number i (0-based) goes to valid.txt when i % 20 == 19, else to train.txt;
# each file is appended whole, in that order. So about 5% of the files are held out, whole files only (no
# validation window shares a file with training data). Prints and writes (MANIFEST) the package version,
# the file and byte counts and the SHA-256 of both files; a rerun with the same package version gives the
# same bytes.
set -euo pipefail

dir=${1:-${PATHATTN_DATA:-$HOME/.cache/pathattn/linux-c}}
sudo=""
if [ "$(id -u)" != 0 ]; then sudo=sudo; fi

if ! dpkg-query -W -f='${Status}' linux-source 2>/dev/null | grep -q "install ok installed"; then
  echo "get_corpus: installing linux-source"
  $sudo apt-get update
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends linux-source
fi
version=$(dpkg-query -W -f='${Version}' linux-source)
tarball=$(ls /usr/src/linux-source-*.tar.xz | LC_ALL=C sort | tail -n 1)
[ -f "$tarball" ] || { echo "get_corpus: no /usr/src/linux-source-*.tar.xz after installing linux-source" >&2; exit 1; }

mkdir -p "$dir"
work=$(mktemp -d "$dir/extract.XXXXXX")
trap 'rm -rf "$work"' EXIT
echo "get_corpus: extracting .c and .h files of $tarball"
tar -xJf "$tarball" -C "$work" --wildcards '*.c' '*.h'
top=$(find "$work" -mindepth 1 -maxdepth 1 -type d | head -n 1)

# The sorted list of files, NUL-separated; then the split by file number.
(cd "$top" && find . -type f \( -name '*.c' -o -name '*.h' \) -print0 | LC_ALL=C sort -z) > "$work/all.lst"
split_list() {  # $1: 0 = training files, 1 = validation files
  (cd "$top" && tr '\0' '\n' < "$work/all.lst" | awk -v want="$1" '{ v = (NR - 1) % 20 == 19; if (v == want) print }')
}
# Kernel paths hold no newlines (checked), so a line per path is safe for the split.
if [ "$(tr -cd '\0' < "$work/all.lst" | wc -c)" != "$(tr '\0' '\n' < "$work/all.lst" | wc -l)" ]; then
  echo "get_corpus: a path with a newline in it; the split rule assumes none" >&2
  exit 1
fi
split_list 0 | (cd "$top" && tr '\n' '\0' | xargs -0 cat) > "$dir/train.txt.tmp"
split_list 1 | (cd "$top" && tr '\n' '\0' | xargs -0 cat) > "$dir/valid.txt.tmp"
mv "$dir/train.txt.tmp" "$dir/train.txt"
mv "$dir/valid.txt.tmp" "$dir/valid.txt"

n_all=$(tr -cd '\0' < "$work/all.lst" | wc -c)
n_val=$(split_list 1 | wc -l)
{
  echo "package: linux-source $version ($(basename "$tarball"))"
  echo "rule: .c/.h files sorted bytewise by path; file i (0-based) to valid when i % 20 == 19"
  echo "files: $n_all total, $((n_all - n_val)) train, $n_val valid"
  echo "train.txt: $(stat -c %s "$dir/train.txt") bytes, sha256 $(sha256sum "$dir/train.txt" | cut -d' ' -f1)"
  echo "valid.txt: $(stat -c %s "$dir/valid.txt") bytes, sha256 $(sha256sum "$dir/valid.txt" | cut -d' ' -f1)"
} > "$dir/MANIFEST"
cat "$dir/MANIFEST"
echo "get_corpus: $dir/train.txt, $dir/valid.txt"
