"""Email over IMAP and SMTP (aioimaplib, aiosmtplib): see `adapters.mail.adapter`."""

from adapters.mail.adapter import EmailAdapter

__all__ = ["EmailAdapter"]
