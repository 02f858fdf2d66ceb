#!/usr/bin/env bash
# `make test`: the suite in passes. The parallel pass runs every test not marked `serial` in
# TEST_WORKERS pytest-xdist workers, a test file each at a time. A `serial` test stops every Ray
# process it can see (`ray stop --force`) and takes Ray's fixed ports (6379-6381), so none runs
# beside another test as it is.
#
# As root, where unshare and ip give it namespaces, each serial test that needs no network (not
# marked `network`) runs beside the parallel pass in PID, mount and network namespaces of its own:
# the stop reaches only its processes, the ports are its own loopback's, and Ray's files (/tmp/ray,
# where a cluster records the address that `--address auto` joins) are a tmpfs of its own. The
# other serial tests run after the parallel pass, alone; without namespaces, all of them do.
# Every pass runs to its end; the exit status is the first failing pass's.
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PY:-.venv/bin/python}
workers=${TEST_WORKERS:-2}

parallel_pass() {  # every test not marked `serial`, TEST_WORKERS files at a time
    "$py" -m pytest -q -n "$workers" --dist loadfile -m "not serial" tests
}

serial_pass() {  # pytest's exit status, "no test selected" (5) counting as success (under set -e too)
    local s=0
    "$py" -m pytest -q "$@" tests || s=$?
    [ "$s" = 5 ] && return 0 || return "$s"
}

namespaces() {  # whether this machine gives the serial tests namespaces of their own
    local probe
    probe=$(mktemp -d) || return 1
    [ "$(id -u)" = 0 ] && command -v unshare >/dev/null && command -v ip >/dev/null \
        && unshare --net --pid --fork --mount-proc sh -c "ip link set lo up && mount -t tmpfs tmpfs $probe" 2>/dev/null
    local ok=$?
    rmdir "$probe"
    return "$ok"
}

if ! namespaces; then
    echo "test-suite.sh: no namespaces here (root, unshare and ip): the serial tests run after the others"
    parallel_pass
    p=$?
    serial_pass -m serial
    s=$?
    [ "$p" = 0 ] && exit "$s" || exit "$p"
fi

# Without network the namespace's tests take the catalog model they cut from the cache: fetched
# first, outside the namespace, while the parallel pass starts (its workers wait on the same fetch's
# lock where they need the model). A failed fetch fails this pass with the fetch's own line.
scratch=$(mktemp -d) || exit 1
export py && export -f serial_pass  # the namespace's bash runs the same pass
(
    "$py" -m matrix models fetch smollm2-135m >/dev/null || exit 1
    exec unshare --kill-child --net --pid --fork --mount-proc env BASETEMP="$scratch/pytest" bash -c '
        set -e
        ip link set lo up
        mkdir -p /tmp/ray && mount -t tmpfs tmpfs /tmp/ray
        serial_pass -p no:cacheprovider -m "serial and not network" --basetemp "$BASETEMP"'
) >"$scratch/serial.log" 2>&1 &
beside=$!
trap 'pkill -P "$beside" 2>/dev/null; kill "$beside" 2>/dev/null; wait "$beside" 2>/dev/null; rm -rf "$scratch"' EXIT
parallel_pass
p=$?
wait "$beside"
b=$?
echo "serial tests beside the parallel pass, in namespaces of their own:"
cat "$scratch/serial.log"
serial_pass -m "serial and network"
s=$?
for status in "$p" "$b" "$s"; do
    [ "$status" = 0 ] || exit "$status"
done
