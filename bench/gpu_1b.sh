# Sourced by bench/gpu_sNN.sh on the device host (with its MODE set), after bench/gpu_run.sh's set-up: the results
# folder R ($OUT/sNN-MODE), the scratch folder W, the 1b preset's source model S and its view with EOS unreachable M
# (made once per machine), and `tables FILE`, a results.md's throughput tables.
R=$OUT/$(basename "$0" .sh | sed 's/^gpu_//')-$MODE
mkdir -p "$R"
W=/tmp/bw S=/tmp/bw/source/1b M=/tmp/bw/models/bench-1b
[ -e "$M/model.safetensors" ] || rm -rf "$M"
[ -d "$M" ] || python3 -c "
from pathlib import Path
from bench.model import make_never_eos_view, make_source_model
make_never_eos_view(make_source_model(Path('$S'), '1b', 0), Path('$M'))" > /dev/null || exit 6
echo "model at ${SECONDS}s"
tables() { sed -n '/^| clients | side/,/^$/p;/^| clients | mlxsup \/ in-process/,/^$/p;/^| clients | ITL/,/^$/p' "$1"; }
