"""Image input: the images of a request's parts, loaded and checked before its job is queued.

An image comes as a ``data:`` URL, an ``http(s)`` URL (fetched only when the operator allows it,
never from a private address they did not allow) or an uploaded file; whichever, it is decoded
here and taken only if it is an image within the limits. The job names it by SHA-256; its bytes
are stored once beside the job, so workers never fetch anything.
"""
