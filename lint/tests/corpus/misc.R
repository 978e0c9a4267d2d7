# seq, NA comparisons, vector logic, quotes, semicolons, comments.
for (i in 1:length(x)) print(i)
for (i in 1:nrow(df)) print(i)
for (i in 1:ncol(df)) print(i)
for (i in 1:NROW(x)) print(i)
for (i in 1:dim(x)[1]) print(i)
for (i in seq(length(x))) print(i)
for (i in seq(nrow(x))) print(i)
for (i in seq_along(x)) print(i)
for (i in 2:length(x)) print(i)
y <- 1:n()
if (x == NA) 1
if (x != NA_integer_) 1
if (NA == x) 1
z <- is.na(x)
if (a & b) 1
if (a | b) 1
if (a && b) 1
while (a & b) break
if (any(a & b)) 1
if (x[a & b]) 1
if ((a & b)) 1
s <- 'single'
t2 <- "double"
u <- 'it"s'
v <- "it's"
w <- r'(raw)'
a <- 1;
b <- 2; c <- 3
d <- 4; # trailing comment
# x <- 1
# print(x)
# This is prose.
# TODO: fix this (later)
# a + b
#' @param x roxygen
## y <- f(2)
# if (x) {
# }
# !isTRUE(x)
k <- 1 # k <- 2
expect_true(a & b)
expect_false(a | b)
