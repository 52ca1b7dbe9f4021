"""The ``ray`` backend: one Ray actor per group, on one machine or a cluster. ``backend`` (the
driver's side and the registration), ``actor`` (the actor), ``helper`` (the envfleet helper of
each node that holds actors: their stacks, replays and memory, read there and handed to the
driver through Ray), ``plan`` (connecting and placing the actors). Importing this package
imports no ``ray``; its modules do."""
