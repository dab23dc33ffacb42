"""`genrun bench`: the engine's own benchmark against a whole genrun run on the same work. A room
above the driver: it runs genrun as a user does (a subprocess), and nothing in the product imports it."""
