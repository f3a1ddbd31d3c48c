# Sourced by deploy/test.sh: the Debian packages the test suite needs beyond Python -
# iptables and the netfilter-queue headers for the network-namespace tests (their
# delay helper, tests/netdelay.py, builds NetfilterQueue against them); Docker,
# docker-compose and debootstrap for the image test (tests/test_image.py builds a
# base with debootstrap, as no registry is reachable); systemd-analyze for the unit
# file's check (tests/test_deploy_manifests.py); Prometheus and promtool for the
# alert rules (tests/test_dashboards.py checks them; tests/test_prometheus.py runs
# a Prometheus of its own, on a free port, against a cluster). Installed with
# apt-get when missing and running as root (CI runs as root); otherwise a line says
# what the tests that need them will lack.
_sevendb_need=()
command -v iptables >/dev/null 2>&1 || _sevendb_need+=(iptables)
[ -e /usr/include/libnetfilter_queue/libnetfilter_queue.h ] || _sevendb_need+=(libnetfilter-queue-dev)
command -v ip >/dev/null 2>&1 || _sevendb_need+=(iproute2)
command -v dockerd >/dev/null 2>&1 || _sevendb_need+=(docker.io)
command -v docker-compose >/dev/null 2>&1 || docker compose version >/dev/null 2>&1 \
    || _sevendb_need+=(docker-compose)
command -v debootstrap >/dev/null 2>&1 || _sevendb_need+=(debootstrap)
command -v systemd-analyze >/dev/null 2>&1 || _sevendb_need+=(systemd)
command -v promtool >/dev/null 2>&1 || _sevendb_need+=(prometheus)
if [ "${#_sevendb_need[@]}" -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "installing Debian packages: ${_sevendb_need[*]}" >&2
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${_sevendb_need[@]}" >/dev/null \
            || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive \
                 apt-get install -y -q "${_sevendb_need[@]}" >/dev/null; }
    else
        echo "note: missing ${_sevendb_need[*]} (needs root and apt-get): the network-namespace," \
            "image, deploy-manifest and Prometheus tests will fail" >&2
    fi
fi
unset _sevendb_need
