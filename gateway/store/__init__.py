"""The store: state.db, migrations, SessionStore, journal, transcripts, search index."""
