"""The Kubernetes API side both programs share, apart from any GPU or health concept: the client (one method per
verb and resource over one kept-alive connection), its errors, views and the narrow protocols its users depend on,
the Event body, the rate limiter and the paced-writer base of the node agent's writers."""
