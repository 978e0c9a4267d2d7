x = 1
y -> z
w ->> v
a <<- 2
f <- function (a=1, b) {a}
g(a=1,b = 2 , c)
x[1,]
x[ 1, 2 ]
y[[ 1 ]]
if(x == NA) {
  1
}
while (x)y
for(i in 1:length(x)) print(i)
z <- 'abc'
T <- F
q <- x$T
if (a & b) 1 else 2
if (any(a & b)) 1
h <- function(x) { if (a | b) 1 }
s <- seq(nrow(x)); t <- 1:n()
	x <- 2
# x <- 1
# this is a comment (really)
a <-(1) + -(2) + x -(3)
myVeryLongVariableNameIsHereAndLongerThanThirty <- 1
camelCase <- 2
print.foo <- function(x) x
x %>%
  f() %>% g()
k <- function(x)
  x + 1
if (x) {
  1
} else {
  2
}
if (x) 1 else {
  2
}
{ 1 }
f( )
f (x)
1+2
x <- 1;
y <- 2; z <- 3
 
x <- 1  


