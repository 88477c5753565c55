"""Starting ranks: the local rank spawner and its forkserver (launch.py), the rank server `tessera train`
starts before its own imports (rank_server.py), and what this machine's memory allows (host_memory.py)."""
