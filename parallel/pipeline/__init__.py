"""Pipeline parallelism: schedules as data, a validator, a simulator and one generic executor."""
