"""Operations: service unit, status, doctor, sd_notify, logs, metrics, terminal chat."""
