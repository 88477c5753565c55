"""Pipeline schedules as data (schedule.py), the simulator that proves them (simulator.py) and the
schedule files of --schedule-file (schedule_files.py); pure Python, no torch."""
