"""Serving queue deliveries: intake (pull by capacity), delivery (decode, admit, stream), settlement (commit, reply, ack)."""
