#!/usr/bin/env bash
# `make test`: the suite in passes. The parallel pass runs every test not marked `serial` in
# TEST_WORKERS pytest-xdist workers, a test file each at a time. A `serial` test stops every Ray
# process it can see (`ray stop --force`) and takes Ray's fixed ports (6379-6381), so none runs
# beside another test as it is.
#
# As root with unshare and ip (CI), where namespaces work, the serial tests that need no network (not marked `network`) run
# beside the parallel pass in PID, mount and network namespaces of their own: the stop reaches only
# their processes, the ports are their own loopback's, and Ray's files (/tmp/ray, where a cluster
# records the address that `--address auto` joins) are a tmpfs of their own. The rest of the serial
# tests run after the parallel pass, alone. Every pass runs to its end; the exit status is the first
# failure's.
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PY:-.venv/bin/python}
workers=${TEST_WORKERS:-2}

pass_() {  # pytest's exit status, with "no test selected" (5) as success
    "$py" -m pytest -q "$@" tests
    local s=$?
    [ "$s" = 5 ] && return 0 || return "$s"
}

namespaces() {  # whether this machine lets the serial tests have namespaces of their own
    [ "$(id -u)" = 0 ] && command -v unshare >/dev/null && command -v ip >/dev/null \
        && unshare --net --pid --fork --mount-proc sh -c 'ip link set lo up && mount -t tmpfs tmpfs /mnt' 2>/dev/null
}

if ! namespaces; then
    pass_ -n "$workers" --dist loadfile -m "not serial"
    p=$?
    pass_ -m serial
    s=$?
    [ "$p" = 0 ] && exit "$s" || exit "$p"
fi

# Without network, the namespace's tests take the catalog model from the cache: fetched here first.
"$py" -m matrix models fetch smollm2-135m >/dev/null || exit 1
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
unshare --net --pid --fork --mount-proc env PY="$py" BASETEMP="$scratch/pytest" bash -c '
    set -e
    ip link set lo up
    mkdir -p /tmp/ray && mount -t tmpfs tmpfs /tmp/ray
    "$PY" -m pytest -q -m "serial and not network" --basetemp "$BASETEMP" tests && exit 0 || s=$?
    [ "$s" = 5 ] && exit 0 || exit "$s"' >"$scratch/serial.log" 2>&1 &
beside=$!
pass_ -n "$workers" --dist loadfile -m "not serial"
p=$?
wait "$beside"
b=$?
echo "serial tests beside the parallel pass, in namespaces of their own:"
cat "$scratch/serial.log"
pass_ -m "serial and network"
s=$?
for status in "$p" "$b" "$s"; do
    [ "$status" = 0 ] || exit "$status"
done
