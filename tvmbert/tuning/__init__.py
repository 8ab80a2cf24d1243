"""MetaSchedule tuning: the database (its files, the MetaSchedule class over them, locking and
compaction), the catalog of every CPU's records, measuring, the search, default schedules, and
compiling with databases applied. May import everything below it: core to passes."""
