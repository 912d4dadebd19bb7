"""Training: the trainer behind `dtmt train` (`trainer`), the process group of a multi-process run
(`distributed`) and the learning-rate schedules (`schedules`)."""
