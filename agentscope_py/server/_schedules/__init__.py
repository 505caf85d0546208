"""Scheduled runs: ``POST/GET/DELETE /v1/schedules``. A schedule (`spec`) is kept in a
`ScheduleStore` beside the run log (`store`, `store_sqlite`, `store_redis`); a `Scheduler` in each
serve process claims each tick once across processes and starts its run through the same path as
``POST /v1/runs`` (`scheduler`); ``endpoints`` answers the HTTP API."""
