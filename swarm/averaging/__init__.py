"""The swarm's training: HivemindStrategy (a Lightning strategy around hivemind.Optimizer), DiLoCo, the round
screen and the state guard, and the clock that times each round. Imports the base modules of ``swarm``,
``swarm.patches`` and the layers below it."""
