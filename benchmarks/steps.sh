# Bounded steps for a lent machine's one call, sourced by lent_machine.sh and gpu_run.sh: each
# step's stdout to $OUT/NAME, its stderr to $log, stopped whole at its limit (timeout stops its
# process group: exit 124), so that the finished steps come back when a later one runs out of time.
# The caller sets OUT, log and steps (" name name ... ").

step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2 start
    shift 2
    start=$(date +%s)
    echo "== $name: $*" >> "$log"
    timeout "$limit" "$@" > "$OUT/$name" 2>> "$log"
    echo "== $name: exit $? after $(( $(date +%s) - start )) s" | tee -a "$log"
}

run() { [[ $steps == *" $1 "* ]]; }  # whether step $1 was asked for
