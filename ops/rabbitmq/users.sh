#!/usr/bin/env bash
# kvflow's RabbitMQ users and their permissions (idempotent; run it again to change a
# password). Two roles, with RabbitMQ's own configure/write/read regexes:
#
#   producer  publishes requests to the exchange kvflow and reads its replies: it may
#             declare and read its own anonymous reply queue (amq.gen-*, amq_*), write to
#             the exchange kvflow only, never to kvflow.control, never declare the
#             topology (connect with declare_topology=False / `kvflow submit --no-declare`).
#   worker    the workers and the admin CLI: declares and uses kvflow's exchanges and
#             queues (names matching KVFLOW_RESOURCES), its control queue, and replies
#             through the default exchange.
#
# Environment (passwords are read from it and never printed):
#   KVFLOW_PRODUCER_USER / KVFLOW_PRODUCER_PASSWORD   default user kvflow-producer
#   KVFLOW_WORKER_USER / KVFLOW_WORKER_PASSWORD       default user kvflow-worker
#   KVFLOW_VHOST       default /
#   KVFLOW_EXCHANGE    the request exchange, default kvflow
#   KVFLOW_RESOURCES   regex of the worker's exchanges and queues, default kvflow(\..*)?
#   RABBITMQ_NODE      the node to talk to (rabbitmqctl -n), default the local one
# `users.sh --print` prints the permissions (user configure write read), changes nothing.
set -euo pipefail

producer=${KVFLOW_PRODUCER_USER:-kvflow-producer}
worker=${KVFLOW_WORKER_USER:-kvflow-worker}
vhost=${KVFLOW_VHOST:-/}
exchange=${KVFLOW_EXCHANGE:-kvflow}
resources=${KVFLOW_RESOURCES:-'kvflow(\..*)?'}
quote() { printf '%s' "$1" | sed 's/[.[\*^$()+?{|]/\\&/g'; }  # a name as a literal regex
# Server-named queues (amq.gen-*), and those a robust client names itself (amq_<hex>).
replies='amq(\.gen-.*|_[0-9a-f]+)'
producer_perms=("^${replies}\$" "^$(quote "$exchange")\$" "^${replies}\$")
worker_perms=(
  "^(${resources}|${replies})\$"
  "^(${resources}|${replies}|amq\.default)\$"
  "^(${resources}|${replies})\$"
)
if [ "${1:-}" = "--print" ]; then
  printf '%s %s %s %s\n' "$producer" "${producer_perms[@]}" "$worker" "${worker_perms[@]}"
  exit 0
fi
: "${KVFLOW_PRODUCER_PASSWORD:?set KVFLOW_PRODUCER_PASSWORD}"
: "${KVFLOW_WORKER_PASSWORD:?set KVFLOW_WORKER_PASSWORD}"

ctl() { rabbitmqctl ${RABBITMQ_NODE:+-n "$RABBITMQ_NODE"} -q "$@"; }

ensure_user() {  # ensure_user NAME PASSWORD: create it, or set its password
  if ctl list_users | cut -f1 | grep -qxF -- "$1"; then
    printf '%s' "$2" | ctl change_password "$1" >/dev/null
  else
    printf '%s' "$2" | ctl add_user "$1" >/dev/null
  fi
}

ctl list_vhosts | grep -qxF -- "$vhost" || ctl add_vhost "$vhost"
ensure_user "$producer" "$KVFLOW_PRODUCER_PASSWORD"
ensure_user "$worker" "$KVFLOW_WORKER_PASSWORD"

ctl set_permissions -p "$vhost" "$producer" "${producer_perms[@]}"
ctl set_permissions -p "$vhost" "$worker" "${worker_perms[@]}"
echo "rabbitmq: users $producer (producer) and $worker (worker) set on vhost $vhost"
