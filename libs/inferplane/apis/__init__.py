"""The public APIs that are another wire format of one conversation (Anthropic Messages,
OpenAI Responses): each converts its request into the `ChatCompletionRequest` the replica's
chat pipeline renders, defined once here for the endpoint picker and the replica alike, so
both decide and serve the same prompt. The responses are written replica-side.
"""
