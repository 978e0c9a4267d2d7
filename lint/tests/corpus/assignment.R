# Assignments of every kind.
x = 1
y <- 2
3 -> z
4 ->> w
v <<- 5
f <- function(a = 1, b=2) a + b
g <- f(a = 1, b=2)
h = function() NULL
k <- (m = 3)
lst <- list(p=1, q = 2)
