"""The glue between the server and durable runs on Temporal (the ``temporal`` extra): serving a
durable run (`serving`), its AG-UI frames (`agui`), answering a run that waits (`answers`), and
the run limits of its streams (`slots`)."""
