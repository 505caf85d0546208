"""Native runs and their logs: the runs of this process (`runs`), one run in progress and its
clients (`live`), its events as frames in either vocabulary (`frames`), and the run log in
memory, SQLite or Redis (`runlog*`) with how this process writes (`logwrites`) and reads
(`logtail`) it."""
