"""Duplex-native sessions: OpenAI's GPT-Live protocol (``/v1/live/sessions``) in front of a
pipeline that takes its own turns (a full-duplex model such as ``duplex-tiny``).

``events`` is the wire vocabulary (client events parsed and checked, server events built),
``core`` the sans-I/O session, ``driver`` its runtime request and connection, ``hosting`` the
session layer (identity, slots, retention, resume) composed through :mod:`session.lifecycle`.
"""
