#!/usr/bin/env bash
# A throwaway single-node Ceph radosgw (a real S3 server) on 127.0.0.1, for the S3 test suite.
#
#   radosgw.sh install         apt-get the Ceph packages (only if `radosgw` is not on PATH)
#   radosgw.sh up DIR PORT     start 1 mon + 1 OSD + radosgw under DIR (which must not exist or be empty);
#                              S3 on http://127.0.0.1:PORT, access key "testkey", secret "testsecret"
#   radosgw.sh down DIR        stop exactly the daemons started by `up DIR` (by their pid files), remove DIR
#
# Adapted from /work/shared/tools/ceph_rgw_up.sh / ceph_rgw_down.sh (Debian 12: Ceph 16.2.15, run as root).
# No mgr (not needed for RADOS or RGW). The mon listens on two free ports picked at `up`, so several
# clusters can run side by side as long as DIR and PORT differ.
#
# Object store: bluestore on a sparse file DIR/osd/block of OSD_GIB GiB (default 10; benchmarks/bench_s3.py at
# 4 GiB wants 40) (OSD_STORE=memstore to override). Bluestore
# keeps the OSD at a few hundred MiB RSS whatever the amount of data (the data goes to disk, written blocks
# only), where memstore keeps every byte in RAM (its RSS grew to 4.5 GiB in a 256 MB benchmark). Bluestore
# opens its block file with O_DIRECT: DIR on tmpfs works on Linux >= 6.6 only (and then holds the data in RAM).
#
# `up` needs no ulimit change (the OSD raises its own open-files limit as root). RADOS objects are capped at
# 128 MiB ("osd max object size"), but RGW stripes S3 objects into 4 MiB RADOS objects, so that cap does not
# limit S3 object sizes; a single S3 PUT is capped at 5 GiB ("rgw max put size"), as on AWS.
# The daemons stay in the caller's process group (Ctrl-C or killing that group stops them too); anything else
# that ends the caller leaves them running until `down DIR`. Without a mgr, `ceph osd df` and other mgr
# commands hang: use `timeout`. S3 bucket names need 3+ characters (InvalidBucketName otherwise).
set -euo pipefail

PACKAGES=(radosgw ceph-mon ceph-osd ceph-common)
DAEMONS=(rgw osd mon)  # stop order

die() { echo "radosgw.sh: $*" >&2; exit 1; }

show_log() {  # show_log FILE...: the tail of each existing log, on stderr
    local f
    for f in "$@"; do
        [ -s "$f" ] || continue
        echo "----- tail of $f -----" >&2
        tail -n 30 "$f" >&2
    done
}

port_in_use() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

free_port() {  # a port nobody listens on, in 20000-59999
    local p i
    for i in $(seq 200); do
        p=$((20000 + RANDOM % 40000))
        port_in_use "$p" || { echo "$p"; return 0; }
    done
    die "no free port found"
}

uuid() { cat /proc/sys/kernel/random/uuid; }

cmd_install() {
    if command -v radosgw >/dev/null 2>&1; then
        return 0
    fi
    [ "$(id -u)" = 0 ] || die "install needs root (apt-get install ${PACKAGES[*]})"
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-cache show radosgw >/dev/null 2>&1; then
        apt-get update -qq || die "apt-get update failed"
    fi
    apt-get install -y -qq --no-install-recommends -o Dpkg::Use-Pty=0 "${PACKAGES[@]}" >/dev/null \
        || die "apt-get install ${PACKAGES[*]} failed"
    command -v radosgw >/dev/null 2>&1 || die "radosgw still not on PATH after install"
}

stop_daemons() {  # stop_daemons DIR: TERM each started daemon, wait, KILL if it lingers
    local d=$1 n f p i
    for n in "${DAEMONS[@]}"; do
        f="$d/pids/$n.pid"
        [ -s "$f" ] || continue
        p=$(cat "$f")
        if kill -0 "$p" 2>/dev/null; then
            kill -TERM "$p" 2>/dev/null || true
            for i in $(seq 100); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
            if kill -0 "$p" 2>/dev/null; then
                kill -KILL "$p" 2>/dev/null || true
                for i in $(seq 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
            fi
            kill -0 "$p" 2>/dev/null && echo "radosgw.sh: $n pid $p did not exit" >&2
        fi
        rm -f "$f"
    done
}

cmd_up() {
    [ $# -eq 2 ] || die "usage: radosgw.sh up DIR PORT"
    local port=$2 d c fsid mon2 mon1 osd_uuid osd_id store osd_gib i
    case $port in ''|*[!0-9]*) die "PORT must be a number, got '$port'" ;; esac
    [ "$port" -ge 1 ] && [ "$port" -le 65535 ] || die "PORT must be in 1-65535, got $port"
    command -v radosgw >/dev/null 2>&1 || die "radosgw is not installed: run 'radosgw.sh install' first"
    port_in_use "$port" && die "port $port on 127.0.0.1 is already in use"
    mkdir -p "$1"
    d=$(cd "$1" && pwd)
    [ -z "$(ls -A "$d")" ] || die "$d is not empty (a running cluster? run 'radosgw.sh down $d' first)"
    store=${OSD_STORE:-bluestore}
    osd_gib=${OSD_GIB:-10}
    case $osd_gib in ''|*[!0-9]*) die "OSD_GIB must be a whole number of GiB, got '$osd_gib'" ;; esac
    c=$d/ceph.conf
    mkdir -p "$d"/{mon,osd,rgw,run,log,pids}
    fsid=$(uuid)
    mon2=$(free_port)
    mon1=$(free_port)
    [ "$mon1" != "$mon2" ] || mon1=$(free_port)

    # From here on, a failure stops whatever was started and leaves DIR (its logs) for inspection.
    trap 'rc=$?; if [ $rc -ne 0 ]; then stop_daemons "'"$d"'"; fi' EXIT

    cat > "$c" <<EOF
[global]
fsid = $fsid
mon host = [v2:127.0.0.1:$mon2,v1:127.0.0.1:$mon1]
mon initial members = a
keyring = $d/keyring
run dir = $d/run
admin socket = $d/run/\$name.asok
log file = $d/log/\$name.log
auth cluster required = cephx
auth service required = cephx
auth client required = cephx
osd pool default size = 1
osd pool default min size = 1
mon allow pool size one = true
mon warn on pool no redundancy = false
osd pool default pg autoscale mode = off
osd pool default pg num = 8
osd pool default pgp num = 8
mon max pg per osd = 1000
osd crush chooseleaf type = 0
ms bind ipv6 = false
mon data avail warn = 2
mon data avail crit = 1
[mon]
mon data = $d/mon
[osd]
osd data = $d/osd
keyring = $d/osd/keyring
osd max object size = 134217728
EOF
    if [ "$store" = bluestore ]; then
        cat >> "$c" <<EOF
osd objectstore = bluestore
bluestore block create = true
bluestore block size = $((osd_gib << 30))
bluestore fsck on mkfs = false
bluestore cache size = 268435456
osd memory target = 939524096
EOF
    else
        cat >> "$c" <<EOF
osd objectstore = memstore
memstore device bytes = 6442450944
EOF
    fi
    cat >> "$c" <<EOF
[client.rgw.a]
rgw frontends = beast endpoint=127.0.0.1:$port
rgw data = $d/rgw
keyring = $d/rgw/keyring
rgw thread pool size = 64
# Free deleted/overwritten objects' data within a minute or two (default: after 2 h), so a long test
# session does not fill the 10 GiB OSD.
rgw gc obj min wait = 30
rgw gc processor period = 30
EOF

    # mon
    ceph-authtool --create-keyring "$d/keyring" --gen-key -n mon. --cap mon 'allow *' >/dev/null
    ceph-authtool "$d/keyring" --gen-key -n client.admin \
        --cap mon 'allow *' --cap osd 'allow *' --cap mgr 'allow *' --cap mds 'allow *' >/dev/null
    monmaptool --create --addv a "[v2:127.0.0.1:$mon2,v1:127.0.0.1:$mon1]" --fsid "$fsid" "$d/monmap" >/dev/null
    ceph-mon -c "$c" --mkfs -i a --monmap "$d/monmap" --keyring "$d/keyring" >"$d/log/mon-mkfs.out" 2>&1 \
        || { show_log "$d/log/mon-mkfs.out" "$d/log/mon.a.log"; die "ceph-mon --mkfs failed"; }
    ceph-mon -c "$c" -i a -f >"$d/log/mon.out" 2>&1 &
    echo $! >"$d/pids/mon.pid"
    for i in $(seq 60); do
        timeout 5 ceph -c "$c" mon stat >/dev/null 2>&1 && break
        kill -0 "$(cat "$d/pids/mon.pid")" 2>/dev/null || break
        sleep 0.5
    done
    timeout 10 ceph -c "$c" mon stat >/dev/null 2>&1 \
        || { show_log "$d/log/mon.out" "$d/log/mon.a.log"; die "the mon did not come up"; }

    # osd
    osd_uuid=$(uuid)
    osd_id=$(timeout 30 ceph -c "$c" osd new "$osd_uuid")
    [ "$osd_id" = 0 ] || die "unexpected OSD id '$osd_id'"
    timeout 30 ceph -c "$c" auth get-or-create osd.0 mon 'allow profile osd' osd 'allow *' mgr 'allow profile osd' \
        -o "$d/osd/keyring" 2>/dev/null
    ceph-osd -c "$c" -i 0 --mkfs --osd-uuid "$osd_uuid" >"$d/log/osd-mkfs.out" 2>&1 \
        || { show_log "$d/log/osd-mkfs.out" "$d/log/osd.0.log"; die "ceph-osd --mkfs failed"; }
    ceph-osd -c "$c" -i 0 -f >"$d/log/osd.out" 2>&1 &
    echo $! >"$d/pids/osd.pid"
    for i in $(seq 120); do
        timeout 5 ceph -c "$c" osd stat 2>/dev/null | grep -q "1 up" && break
        kill -0 "$(cat "$d/pids/osd.pid")" 2>/dev/null || break
        sleep 0.5
    done
    timeout 10 ceph -c "$c" osd stat 2>/dev/null | grep -q "1 up" \
        || { show_log "$d/log/osd.out" "$d/log/osd.0.log"; die "the OSD did not come up"; }

    # rgw
    timeout 30 ceph -c "$c" auth get-or-create client.rgw.a mon 'allow rw' osd 'allow rwx' -o "$d/rgw/keyring" 2>/dev/null
    radosgw -c "$c" -n client.rgw.a -f >"$d/log/rgw.out" 2>&1 &
    echo $! >"$d/pids/rgw.pid"
    for i in $(seq 180); do
        curl -s -o /dev/null --max-time 2 "http://127.0.0.1:$port/" && break
        kill -0 "$(cat "$d/pids/rgw.pid")" 2>/dev/null || break
        sleep 0.5
    done
    curl -s -o /dev/null --max-time 5 "http://127.0.0.1:$port/" \
        || { show_log "$d/log/rgw.out" "$d/log/client.rgw.a.log"; die "radosgw did not answer on 127.0.0.1:$port"; }
    timeout 60 radosgw-admin -c "$c" user create --uid=test --display-name=test \
        --access-key=testkey --secret=testsecret >"$d/log/user.json" 2>"$d/log/user.err" \
        || { show_log "$d/log/user.err" "$d/log/client.admin.log"; die "radosgw-admin user create failed"; }
    # Authenticated request: the user is visible to the gateway (ListBuckets answers 200, not 403).
    for i in $(seq 60); do
        curl -s -o /dev/null -f --max-time 5 --aws-sigv4 "aws:amz:us-east-1:s3" --user testkey:testsecret -H "x-amz-content-sha256: UNSIGNED-PAYLOAD" \
            "http://127.0.0.1:$port/" && break
        sleep 0.5
    done
    curl -s -o /dev/null -f --max-time 5 --aws-sigv4 "aws:amz:us-east-1:s3" --user testkey:testsecret -H "x-amz-content-sha256: UNSIGNED-PAYLOAD" \
        "http://127.0.0.1:$port/" \
        || { show_log "$d/log/client.rgw.a.log"; die "radosgw refuses the test user's requests"; }
    trap - EXIT
    echo "radosgw up: http://127.0.0.1:$port (mon $mon2/$mon1; pids mon=$(cat "$d/pids/mon.pid")" \
        "osd=$(cat "$d/pids/osd.pid") rgw=$(cat "$d/pids/rgw.pid"); $store)"
}

cmd_down() {
    [ $# -eq 1 ] || die "usage: radosgw.sh down DIR"
    local d=$1
    [ -e "$d" ] || return 0
    [ -f "$d/ceph.conf" ] || [ -d "$d/pids" ] || die "$d does not look like a radosgw.sh directory; not removing it"
    stop_daemons "$d"
    rm -rf "$d"
}

case ${1:-} in
    install) shift; cmd_install "$@" ;;
    up) shift; cmd_up "$@" ;;
    down) shift; cmd_down "$@" ;;
    *) die "usage: radosgw.sh install | up DIR PORT | down DIR" ;;
esac
