"""The memory layer: rolling summaries of long sessions."""
