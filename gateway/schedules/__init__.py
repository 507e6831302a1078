"""Scheduled jobs: cadences and the WHEN syntax (`cadence`), the schedule book
with its validation and scoping (`book`), and the scheduler loop that fires runs exactly
once per fire time (`loop`). The rows live in state.db (`gateway.store.schedules`)."""
