"""The operators' admin CLI: `kvflow workers | status | drain | resume | cancel | scale |
up | dlq | ledger`.

- `common`: connection settings (flags and environment) and the error boundary that
  turns an unreachable broker or database into one clear, password-free line.
- `control_client`: send a command on the control fanout exchange, collect replies.
- `ledger_queries`: what the commands read from (and the few things they write to) the
  ledger: workers, one row, stats, cancel, replay reset, export.
- `dlq`: inspect, replay and purge the dead-letter queue.
- `supervisor`: `kvflow up`, a local process supervisor that obeys `scale` commands.
- `views`: human tables and `--json` output.
- `commands` / `data_commands`: the click commands themselves.
"""
