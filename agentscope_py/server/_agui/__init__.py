"""The AG-UI protocol's parts behind `agentscope_py.server.agui`: the wire events, their
encoding, the input a request carries, message content, sub-agent activity, the snapshot a
resumed thread gets, and the ledger of what each thread was shown."""
