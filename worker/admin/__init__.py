"""The operators' admin CLI: `kvflow workers | status | drain | resume | cancel | scale |
up | dlq | ledger`.

- `commands` (the fleet commands, each in the module of its job: `fleet`, `drain`,
  `cancel`, `scale`) and `data_commands` (`dlq`, `ledger`): the click commands.
- `common`: connection settings (flags and environment) and the error boundary that
  turns an unreachable broker or database into one clear, password-free line.
- `control_client`: send a command on the control fanout exchange, collect replies.
- `queues`: a queue's ready and unacknowledged counts (rabbitmqctl, management API).
- `ledger_queries`: what the commands read from the ledger (writes go through
  `worker.ledger.store.LedgerStore`).
- `dlq`: inspect, replay and purge the dead-letter queue.
- `supervisor`: `kvflow up`, a local process supervisor that obeys `scale` commands.
- `views`: human tables and `--json` output.
"""
