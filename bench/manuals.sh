#!/usr/bin/env bash
# The real technical text of the GPU recipe (bench/ablation/manuals30.yaml, 30 % of the windows): ten GNU manuals
# from /usr/share/info, each written whole, its parts in name order (find.info-1, find.info-2, find.info), into
# .corpus/manuals/NAME.txt, then checked against bench/manuals.sha256, the text sessions 37-44 measured on.
#   bash bench/manuals.sh        (in the checkout; then carry .corpus to the GPU machine, or run it there)
# A manual missing from /usr/share/info stops it with its name; a manual of another version is written and named
# as different, since its students compare with docs/quality.md's only approximately.
set -euo pipefail
export LC_ALL=C  # the parts' order: '-' sorts before '.'
mkdir -p .corpus/manuals
for name in $(sed -E 's|.*/([^/]+)\.txt$|\1|' bench/manuals.sha256); do
  parts=$(ls /usr/share/info/"$name".info*.gz 2> /dev/null | sort) || true
  [[ -n $parts ]] || { echo "bench/manuals.sh: /usr/share/info/$name.info.gz: missing (install the $name package's info manual)" >&2; exit 1; }
  # shellcheck disable=SC2086  # the parts are /usr/share/info paths without spaces
  zcat $parts > ".corpus/manuals/$name.txt.part" && mv ".corpus/manuals/$name.txt.part" ".corpus/manuals/$name.txt"
done
sha256sum -c bench/manuals.sha256 || echo "bench/manuals.sh: the manuals named FAILED differ from the text docs/quality.md measured" >&2
