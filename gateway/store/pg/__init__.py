"""The PostgreSQL backend of the store: its schema, connection and SQL dialect."""
