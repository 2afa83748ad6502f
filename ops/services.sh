#!/usr/bin/env bash
# What the integration tests need outside Python, on Debian 12: installed from Debian's
# packages when missing, set up as the tests' default URLs expect, started when not
# running. Safe to run again; quick when everything is there (CI runs it every time).
# Acts as root only for what needs it (through sudo when not root). `bash ops/setup.sh
# test` runs it.
#
#   RabbitMQ        amqp://guest:guest@127.0.0.1:5672/       rabbitmq-server -detached
#   PostgreSQL      postgresql://postgres@127.0.0.1:5432/test  (database `test`; the user
#                   postgres trusted from 127.0.0.1, as the tests connect without a password)
#   prometheus      a real Prometheus server that scrapes a worker in tests/integration/test_ops.py
#   docker-compose  validates docker-compose.yml without a Docker engine
set -euo pipefail

PACKAGES=(rabbitmq-server postgresql prometheus docker-compose)
TEST_DB=test
HBA_LINE="host all postgres 127.0.0.1/32 trust"

say() { echo "services: $*" >&2; }

as_root() {
  if [ "$(id -u)" -eq 0 ]; then
    "$@"
  elif command -v sudo >/dev/null 2>&1; then
    sudo "$@"
  else
    say "needs root (or sudo) for: $*"
    return 1
  fi
}

wait_for() {  # wait_for <what> <seconds> <command...>
  local what=$1 limit=$2
  shift 2
  for _ in $(seq 1 "$limit"); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 1
  done
  say "$what did not come up within ${limit}s"
  return 1
}

port_open() { timeout 2 bash -c "exec 3<>/dev/tcp/127.0.0.1/$1" 2>/dev/null; }

installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }

# -- packages ------------------------------------------------------------------------------
missing=()
for pkg in "${PACKAGES[@]}"; do
  installed "$pkg" || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  say "installing ${missing[*]} from Debian's packages"
  as_root apt-get update -qq
  # No recommends: docker-compose's would bring the Docker engine, prometheus' exporters.
  as_root env DEBIAN_FRONTEND=noninteractive \
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# -- RabbitMQ ------------------------------------------------------------------------------
if ! port_open 5672; then
  # Erlang names the node after the host; where the host name does not resolve (some
  # containers), the node cannot start under it, so it is named after localhost.
  env_conf=/etc/rabbitmq/rabbitmq-env.conf
  if ! getent hosts "$(hostname -s)" >/dev/null && ! grep -qs '^NODENAME=' "$env_conf"; then
    say "host name $(hostname -s) does not resolve: naming the RabbitMQ node rabbit@localhost"
    echo "NODENAME=rabbit@localhost" | as_root tee -a "$env_conf" >/dev/null
  fi
  say "starting RabbitMQ"
  as_root rabbitmq-server -detached
  wait_for RabbitMQ 120 port_open 5672
fi

# -- PostgreSQL ----------------------------------------------------------------------------
cluster=$(ls /etc/postgresql | sort -V | tail -n 1)
if ! pg_isready -q -h 127.0.0.1 -p 5432; then
  say "starting PostgreSQL $cluster"
  as_root pg_ctlcluster --skip-systemctl-redirect "$cluster" main start
  wait_for PostgreSQL 60 pg_isready -q -h 127.0.0.1 -p 5432
fi

psql_postgres() { psql -h 127.0.0.1 -p 5432 -U postgres -d postgres -w -X -q -At "$@"; }

if ! psql_postgres -c "SELECT 1" >/dev/null 2>&1; then
  hba=/etc/postgresql/$cluster/main/pg_hba.conf
  if ! as_root grep -qxF "$HBA_LINE" "$hba"; then
    say "trusting the user postgres from 127.0.0.1 in $hba (the tests connect without a password)"
    # First match wins: the line goes before Debian's password rule for 127.0.0.1.
    as_root sed -i "1i # kvflow tests: the user postgres from 127.0.0.1 without a password\n$HBA_LINE" "$hba"
  fi
  as_root pg_ctlcluster --skip-systemctl-redirect "$cluster" main reload
  wait_for "PostgreSQL's trust for postgres" 30 psql_postgres -c "SELECT 1"
fi

if [ -z "$(psql_postgres -c "SELECT 1 FROM pg_database WHERE datname = '$TEST_DB'")" ]; then
  say "creating the database $TEST_DB"
  createdb -h 127.0.0.1 -p 5432 -U postgres -w "$TEST_DB"
fi
