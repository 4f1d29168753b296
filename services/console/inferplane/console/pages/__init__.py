"""The console's pages, one module per area; each holds a class of aiohttp handlers over the
shared `inferplane.console.web.Console` (the routes are `inferplane.console.app`'s)."""
