"""Where a role's ranks run and how they are called: in this process or as Ray actors (`group`, `ray_group`,
`ray_rank`, `ray_placement`, `link`), and the typed handles the trainer holds for each role (`roles`).

It builds the workers of `conveyor.workers.ranks`; the training machinery below them is not its business.
"""
