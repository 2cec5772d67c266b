"""The serving limits' defaults (each a ``serve`` flag), in one leaf module that the app, the
HTTP server and the settings all read."""

#: Most inputs per request, characters per text, body bytes, and seconds for the body to arrive.
MAX_INPUTS, MAX_INPUT_CHARS, MAX_BODY_BYTES, BODY_TIMEOUT = 2048, 100_000, 16 << 20, 30.0
#: Seconds a connection may take to send a request's headers; seconds of grace on shutdown.
HEADER_TIMEOUT, GRACE = 10.0, 10.0
