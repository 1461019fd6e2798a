"""Training the zoom-in router (SPEC §3): corpus -> teacher/student forwards -> losses -> router file."""
